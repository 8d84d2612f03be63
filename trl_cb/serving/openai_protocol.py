"""OpenAI's completion and chat-completion bodies as the rollout server reads and answers them (docs/server.md,
"OpenAI-compatible endpoint"), with the RL fields beside them.

Requests own their conversions (as vLLM's do): `prompt_ids(tokenizer)` (texts, token ids, or messages rendered with
the served model's chat template and `tools`; chat's `tokens` is the exact prompt, prime-rl's token-in chat) and
`sampling()` (what the engine applies). OpenAI fields the server cannot honour exactly are refused with 422 naming
them (a streamed `echo`, `suffix`, `best_of` > 1, logprob alternatives, a forced `tool_choice`, a JSON
`response_format`), never ignored; the sampling fields (penalties, `seed`, ...) are `protocol.ServedSampling`'s.
Every rule of `protocol.py` holds too: unknown fields, non-finite numbers, a temperature under 0.01 -> 422.

Answers (`openai_answers.py`) are OpenAI's objects (`text` / `message`, `logprobs` in OpenAI's shape,
`finish_reason`, `usage`). With `return_token_ids` (vLLM's name) they carry the RL fields: `prompt_token_ids` and
`token_ids` (vLLM's convention: both on the choice for completions; the prompt's on the response for chat),
`policy_logprobs` and `token_weight_versions` per token, `weight_version` (the oldest token's). `logprobs` are the
sampled distribution's (after temperature, top-k, top-p); `policy_logprobs` the trainer's `log_softmax(logits/T)`.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..checks.generation_settings import MAX_TOP_LOGPROBS
from .prompt_scoring import MAX_PROMPT_LOGPROBS
from .protocol import (
    MAX_N,
    MAX_PROMPT_TOKENS,
    MAX_PROMPTS,
    MAX_TOKENS,
    Choice,
    CompletionRequest,
    DecodedSamplingRequest,
    PromptIds,
)
from .protocol import _Strict as Strict

__all__ = [
    "AnswerChoice",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionAnswer",
    "DetokenizeRequest",
    "OpenAICompletionRequest",
    "OpenAIError",
    "OpenAISampling",
    "TokenizeRequest",
    "check_finite",
    "context_overflow",
    "model_not_found",
    "openai_error",
]

#: Longest text prompt (characters), checked before it is tokenized.
MAX_PROMPT_CHARS = 8 * MAX_PROMPT_TOKENS
MAX_MESSAGES, MAX_TOOLS = 1024, 128
#: `max_tokens` when a request sets none: OpenAI's 16 for completions; for chat (OpenAI: the rest of the context) a
#: bounded default, since the engine is sized for what requests may generate.
DEFAULT_COMPLETION_MAX_TOKENS, DEFAULT_CHAT_MAX_TOKENS = 16, 512

Text = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


class StreamOptions(Strict):
    include_usage: bool = False


class OpenAISampling(DecodedSamplingRequest):
    """What both OpenAI requests share: sampling, stop strings (`DecodedSamplingRequest`), streaming and the RL
    switches."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    return_token_ids: bool | None = None

    @model_validator(mode="after")
    def _honoured(self) -> OpenAISampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class OpenAICompletionRequest(OpenAISampling):
    """`/v1/completions`: OpenAI's body (a text, texts, token ids, lists of token ids), and trl_cb's client's
    (`protocol.CompletionRequest`, whose `encoding` may ask for the binary answer)."""

    prompt: (
        Annotated[Text, Field(min_length=1)]
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[PromptIds, Field(min_length=1)]
        | Annotated[list[PromptIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: int | None = Field(default=DEFAULT_COMPLETION_MAX_TOKENS, ge=1, le=MAX_TOKENS)
    #: the sampled token's logprob, and its `logprobs` likeliest alternatives (`top_logprobs`)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=1)
    add_special_tokens: bool = True
    encoding: Literal["json", "binary"] = "json"
    detokenize: bool = True  # false: no text (`text` empty), for clients that read token ids only
    #: vLLM's: each prompt token's own logprob and rank under the served policy, and the k most likely tokens at
    #: each position (`prompt_scoring.py`)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_PROMPT_LOGPROBS)

    @model_validator(mode="after")
    def _completion_honoured(self) -> OpenAICompletionRequest:
        if (self.prompt_logprobs is not None or self.echo) and (self.stream or self.encoding != "json"):
            raise ValueError("prompt_logprobs and echo are answered in one JSON object: unset stream and encoding")
        if self.suffix:
            raise ValueError("suffix is not supported (no fill-in-the-middle); unset it")
        if self.logprobs and (self.stream or self.encoding != "json"):
            raise ValueError("logprobs > 0 (alternatives) is answered in one JSON object: unset stream and encoding")
        if self.echo and not self.detokenize:
            raise ValueError("echo puts the prompt's text in the answer: unset echo or detokenize=false")
        if self.encoding != "json" and (self.stream or self.stops() or self.stop_token_ids or self.text_prompts()):
            raise ValueError(
                f"encoding={self.encoding!r} takes token-id prompts only, without stream, stop or stop_token_ids"
            )
        if not self.detokenize and self.stops():
            raise ValueError("stop strings need the text: unset stop or detokenize=false")
        return self

    def max_new_tokens(self) -> int:
        """The completion-token limit under its one name inside trl_cb (`GenerationConfig`'s): `max_tokens`, or
        OpenAI's default."""
        return DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    def sampling(self) -> dict[str, Any]:
        """`DecodedSamplingRequest.sampling()`, with `top_logprobs` where `logprobs` asks for alternatives."""
        return {**super().sampling(), **({"top_logprobs": self.logprobs} if self.logprobs else {})}

    def scored_positions(self) -> int | None:
        """How many alternatives the prompt's scoring needs at each position: `prompt_logprobs`, 0 for `echo` with
        `logprobs` (the prompt tokens' own logprobs), None when nothing is scored."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return 0 if self.echo and self.logprobs is not None else None

    def text_prompts(self) -> bool:
        return isinstance(self.prompt, str) or isinstance(self.prompt[0], str)

    def prompt_ids(self, tokenizer: Any) -> list[list[int]]:
        """Each prompt as token ids (texts through `tokenizer`: `ValueError` without one)."""
        if not self.text_prompts():
            return [list(self.prompt)] if isinstance(self.prompt[0], int) else [list(p) for p in self.prompt]
        if tokenizer is None:
            raise ValueError("this server has no tokenizer: send token-id prompts")
        texts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        return [tokenizer.encode(text, add_special_tokens=self.add_special_tokens) for text in texts]

    def rollout_request(self, prompt_ids: list[list[int]]) -> CompletionRequest:
        """The same request as trl_cb's own body (the binary answer is built from it)."""
        fields = dict(prompt=prompt_ids, n=self.n, max_tokens=self.max_new_tokens(), encoding=self.encoding)
        return CompletionRequest.model_construct(**fields, **self.sampling(), logprobs=None, return_token_ids=True)


class _AnswerLogprobs(BaseModel):
    token_logprobs: list[float]


class AnswerChoice(BaseModel):
    """What trl_cb's client reads of an OpenAI completion choice (a JSON answer to `logprobs=0`,
    `return_token_ids=true`)."""

    index: int
    token_ids: list[int]
    logprobs: _AnswerLogprobs
    policy_logprobs: list[float]
    token_weight_versions: list[int]
    weight_version: int
    finish_reason: str | None = None

    def to_choice(self, n: int) -> Choice:
        """The same sample as trl_cb's `Choice` (sample `index % n` of prompt `index // n`)."""
        return Choice(
            index=self.index,
            prompt_index=self.index // n,
            token_ids=self.token_ids,
            logprobs=self.logprobs.token_logprobs,
            policy_logprobs=self.policy_logprobs,
            weight_version=self.weight_version,
            token_weight_versions=self.token_weight_versions,
            finish_reason=self.finish_reason,
        )


class CompletionAnswer(BaseModel):
    choices: list[AnswerChoice]


def check_finite(value: Any, name: str) -> None:
    """`ValueError` naming `name` for a NaN or infinity anywhere in free-form JSON (messages' extra fields, tool
    schemas, template kwargs): the typed fields refuse them already."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name}: non-finite numbers are not allowed")
    if isinstance(value, dict):
        for item in value.values():
            check_finite(item, name)
    elif isinstance(value, list):
        for item in value:
            check_finite(item, name)


class _ContentPart(Strict):
    type: Literal["text"]
    text: str


class _FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    name: str
    arguments: str | dict[str, Any] = "{}"


class _ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    id: str | None = None
    type: Literal["function"] = "function"
    function: _FunctionCall


class ChatMessage(BaseModel):
    """One message of a conversation; fields a chat template may read beyond these pass through."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_ContentPart] | None = None
    tool_calls: list[_ToolCall] | None = None

    @model_validator(mode="after")
    def _finite_extras(self) -> ChatMessage:
        check_finite(self.model_extra or {}, "messages")
        for call in self.tool_calls or []:
            check_finite(call.model_dump(), "messages")
        return self

    def for_template(self) -> dict[str, Any]:
        """As chat templates read it: text parts joined, tool-call arguments as objects (TRL's form)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        for call in message.get("tool_calls", []):
            arguments = call["function"].get("arguments")
            if isinstance(arguments, str):
                try:
                    call["function"]["arguments"] = json.loads(arguments or "{}")
                except json.JSONDecodeError:
                    pass  # left as the model wrote it
        return message


class ChatCompletionRequest(OpenAISampling):
    """`/v1/chat/completions` (and `/v1/chat/completions/tokens`): `messages` rendered with the served model's chat
    template (`tools` passed to it), or `tokens`, the exact prompt ids (a conversation's previous ids sent back, so a
    multi-turn trajectory never drifts through re-tokenization)."""

    messages: list[ChatMessage] = Field(default_factory=list, max_length=MAX_MESSAGES)
    tokens: Annotated[PromptIds, Field(min_length=1)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token
    response_format: dict[Literal["type"], Literal["text"]] | None = None
    metadata: dict[str, str] | None = None
    store: Literal[False] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_honoured(self) -> ChatCompletionRequest:
        if not self.messages and self.tokens is None:
            raise ValueError("messages (or tokens) must not be empty")
        if self.top_logprobs and (not self.logprobs or self.stream):
            raise ValueError("top_logprobs needs logprobs=true, and is answered in one JSON object: unset stream")
        check_finite(self.tools or [], "tools")
        check_finite(self.chat_template_kwargs or {}, "chat_template_kwargs")
        return self

    def sampling(self) -> dict[str, Any]:
        """`DecodedSamplingRequest.sampling()`, with `top_logprobs` where the request asks for alternatives."""
        return {**super().sampling(), **({"top_logprobs": self.top_logprobs} if self.top_logprobs else {})}

    def max_new_tokens(self) -> int:
        """The completion-token limit under its one name inside trl_cb: `max_completion_tokens` (OpenAI's current
        name) over `max_tokens` (its deprecated one), or the chat default."""
        chosen = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return DEFAULT_CHAT_MAX_TOKENS if chosen is None else chosen

    def offered_tools(self) -> list[dict[str, Any]] | None:
        return None if self.tool_choice == "none" else (self.tools or None)

    def prompt_ids(self, tokenizer: Any) -> list[int]:
        """`tokens` as sent, else the messages rendered with the chat template (`ValueError` without one)."""
        if self.tokens is not None:
            return list(self.tokens)
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("this server's tokenizer has no chat template: send `tokens` or use /v1/completions")
        rendered = tokenizer.apply_chat_template(
            [message.for_template() for message in self.messages],
            tools=self.offered_tools(),
            add_generation_prompt=self.add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **(self.chat_template_kwargs or {}),
        )
        return list(rendered)


class TokenizeRequest(Strict):
    """`/tokenize` (vLLM's): a text, or messages through the chat template (with `tools`), as the server would render
    them for generation; clients that send conversations back as ids (`tokens`) build the next turn's with it."""

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, max_length=MAX_MESSAGES)
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        check_finite(self.tools or [], "tools")
        check_finite(self.chat_template_kwargs or {}, "chat_template_kwargs")
        return self

    def ids(self, tokenizer: Any) -> list[int]:
        if tokenizer is None:
            raise ValueError("this server has no tokenizer")
        if self.prompt is not None:
            return list(tokenizer.encode(self.prompt, add_special_tokens=self.add_special_tokens))
        fields = ("messages", "tools", "chat_template_kwargs", "add_generation_prompt")
        return ChatCompletionRequest(**{name: getattr(self, name) for name in fields}).prompt_ids(tokenizer)


class DetokenizeRequest(Strict):
    """`/detokenize` (vLLM's): token ids to text, as `tokenizer.decode` gives it (special tokens kept, as vLLM)."""

    model: str | None = None
    tokens: PromptIds

    def text(self, tokenizer: Any) -> str:
        """The ids' text; `ValueError` without a tokenizer or for an id outside its vocabulary (never echoed)."""
        if tokenizer is None:
            raise ValueError("this server has no tokenizer")
        size = len(tokenizer)
        if any(not 0 <= token < size for token in self.tokens):
            raise ValueError(f"token ids must be in [0, {size}): the tokenizer's vocabulary")
        return tokenizer.decode(self.tokens)


def model_not_found() -> dict[str, Any]:
    """OpenAI's error object for a model this server does not serve (the id is not echoed)."""
    return openai_error("The model does not exist on this server (see /v1/models).", "model", "model_not_found")


def openai_error(message: str, param: str | None, code: str | int | None) -> dict[str, Any]:
    """OpenAI's error object (`openai` raises its typed errors from it), with trl_cb's `detail` beside it."""
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    return {"error": error, "detail": message}


class OpenAIError(HTTPException):
    """A refusal answered in OpenAI's error shape (`openai_error`), e.g. a context overflow."""

    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | int | None = None):
        super().__init__(status_code=status_code, detail=message)
        self.body = openai_error(message, param, code)


def context_overflow(limit: int, prompt_tokens: int, max_new_tokens: int) -> OpenAIError:
    """vLLM's wording for a prompt plus its completion budget past the context (clients such as `verifiers` read it
    to end a rollout as an overflow, not a provider error): 400."""
    requested = prompt_tokens + max_new_tokens
    message = (
        f"This model's maximum context length is {limit} tokens. However, you requested {requested} "
        f"tokens ({prompt_tokens} in the prompt, {max_new_tokens} in the completion). Please reduce the length of the "
        "prompt or completion."
    )
    return OpenAIError(400, message, param="max_tokens", code=400)
