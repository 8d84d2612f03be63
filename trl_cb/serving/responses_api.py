"""OpenAI's Responses API, `POST /v1/responses` (the OpenAI Agents SDK's default model): one chat completion of the
conversation its `input` describes, answered as a `response` object.

Why a translation and not a second engine path: a response is exactly a chat completion with n = 1. `input` (a text,
or items: messages, the model's earlier `function_call`s and their `function_call_output`s) and `instructions` become
chat messages, the function tools become chat tools, and `OpenAIServing`'s chat machinery samples, decodes and parses
tool calls (TRL's parser). The answer's `output` is a `message` item (`output_text`) and a `function_call` item per
parsed call; `status` is `incomplete` (`max_output_tokens`) when the sample ran out of tokens. Invariants: every
token is a sampled token with its recorded logprob (`include: ["message.output_text.logprobs"]`); with
`return_token_ids` the RL fields of the chat route ride on the response. With `stream`, OpenAI's `response.*` events
(`_ResponseEvents`). Refused (422, naming them): stored state (`previous_response_id`, `conversation`), non-function
tools, non-text input, `n` other than 1.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..rollouts.rollout_groups import RolloutGroup
from .openai_answers import DecodedSample, chat_logprobs, dump, rl_fields
from .openai_protocol import (
    DEFAULT_CHAT_MAX_TOKENS,
    MAX_MESSAGES,
    MAX_TOOLS,
    ChatCompletionRequest,
    ChatMessage,
    OpenAISampling,
    Text,
    check_finite,
)
from .openai_serving import EVENT_STREAM, AnswerContext, Flows, OpenAIServing, all_groups, finished_sample
from .protocol import MAX_TOKENS
from .protocol import _Strict as Strict

__all__ = ["ResponsesRequest", "respond"]

#: The one `include` value served: each output token's logprob on the `output_text` part.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
#: Fields both bodies have that the chat body takes in another shape (or not at all: nothing is stored).
_TRANSLATED = frozenset({"tools", "store", "metadata"})


class _TextPart(Strict):
    """A message's text part: the user's `input_text`, or an earlier answer's `output_text` sent back."""

    type: Literal["input_text", "output_text", "text"]
    text: Text
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class _Message(Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | Annotated[list[_TextPart], Field(max_length=MAX_MESSAGES)]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class _FunctionCall(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: Text
    id: str | None = None
    status: str | None = None


class _FunctionCallOutput(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: Text | list[_TextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


InputItem = _Message | _FunctionCall | _FunctionCallOutput


class _FunctionTool(BaseModel):
    """A function tool in the Responses shape (`name` at the top level; chat nests it under `function`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def for_chat(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class ResponsesRequest(OpenAISampling):
    """`/v1/responses`' body: `input` and `instructions`, function `tools`, `max_output_tokens`, the served sampling
    fields; OpenAI's bookkeeping fields (`store`, `metadata`, `truncation: "disabled"`, `text` in plain format) are
    accepted and change nothing the model samples."""

    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Text | None = None
    tools: Annotated[list[_FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    include: list[Literal["message.output_text.logprobs"]] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=0)  # the sampled token's only: no alternatives
    store: bool | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["disabled"] | None = None
    text: dict[Literal["format"], dict[Literal["type"], Literal["text"]]] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    reasoning: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _responses_honoured(self) -> ResponsesRequest:
        if self.previous_response_id is not None or self.conversation is not None:
            raise ValueError("this server stores no responses: send the whole conversation in `input`")
        if self.n != 1:
            raise ValueError("a response has one output: n must be 1")
        if self.reasoning:
            raise ValueError("reasoning settings are not served: unset reasoning")
        check_finite([tool.parameters for tool in self.tools or []], "tools")
        check_finite(self.chat_template_kwargs or {}, "chat_template_kwargs")
        return self

    def messages(self) -> list[ChatMessage]:
        """The conversation as chat messages: `instructions` as the system message, a function call joined to the
        assistant message before it (or a message of its own), its output as a `tool` message."""
        messages: list[dict[str, Any]] = (
            [{"role": "system", "content": self.instructions}] if self.instructions else []
        )
        items = [_Message(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, _Message):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, _FunctionCall):
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append({"role": "assistant", "content": None})
                function = {"name": item.name, "arguments": item.arguments}
                call = {"id": item.call_id, "type": "function", "function": function}
                messages[-1]["tool_calls"] = [*messages[-1].get("tool_calls", []), call]
            else:
                messages.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id})
        return [ChatMessage.model_validate(message) for message in messages]

    def as_chat(self) -> ChatCompletionRequest:
        """The same request as a chat completion (n = 1), validated as one: every field the two bodies share is
        passed as set (the served sampling fields, stops, the RL switch), the rest translated."""
        shared = (self.model_fields_set & ChatCompletionRequest.model_fields.keys()) - _TRANSLATED
        return ChatCompletionRequest(
            messages=self.messages(),
            tools=[tool.for_chat() for tool in self.tools] if self.tools else None,
            max_completion_tokens=self.max_output_tokens or DEFAULT_CHAT_MAX_TOKENS,
            logprobs=self.include is not None and LOGPROBS_INCLUDE in self.include,
            **{name: getattr(self, name) for name in shared},
        )

    def chat_prompt(self, tokenizer: Any) -> tuple[ChatCompletionRequest, list[int]]:
        """The chat request and its prompt ids (the conversation through the served chat template)."""
        chat = self.as_chat()
        return chat, chat.prompt_ids(tokenizer)


def response_object(
    ctx: AnswerContext, body: ResponsesRequest, model: str, prompt: list[int], group: RolloutGroup
) -> bytes:
    """The `response` object's JSON for the group's one sample."""
    sample = finished_sample(ctx, group, 0, prompt)
    return dump(_response(ctx, body, model, prompt, sample, f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"))


def _response(
    ctx: AnswerContext,
    body: ResponsesRequest,
    model: str,
    prompt: list[int],
    sample: DecodedSample | None,
    response_id: str,
    message_id: str,
) -> dict[str, Any]:
    """The `response` object of `sample` (None: the response still in progress, no output yet)."""
    incomplete = sample is not None and sample.finish_reason == "length"
    status = "in_progress" if sample is None else "incomplete" if incomplete else "completed"
    answer: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "instructions": body.instructions,
        "output": [] if sample is None else _output_items(sample, ctx.logprobs, message_id),
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": body.tool_choice or "auto",
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "usage": None if sample is None else {
            "input_tokens": len(prompt),
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": len(sample.token_ids),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": len(prompt) + len(sample.token_ids),
        },
    }  # fmt: skip
    if ctx.rl and sample is not None:
        answer.update(prompt_token_ids=prompt, **rl_fields(sample, rl=True))
    return answer


def _output_items(sample: DecodedSample, logprobs: bool, message_id: str) -> list[dict[str, Any]]:
    """A `message` item with the text (when there is text, or nothing else), then a `function_call` per call."""
    items: list[dict[str, Any]] = []
    if sample.content or not sample.tool_calls:
        part: dict[str, Any] = {"type": "output_text", "text": sample.content or "", "annotations": []}
        if logprobs:
            part["logprobs"] = chat_logprobs(sample)["content"]
        message = {"type": "message", "role": "assistant", "status": "completed", "content": [part]}
        items.append({"id": message_id, **message})
    for call in sample.tool_calls:
        function = call["function"]
        item = {"type": "function_call", "call_id": call["id"], "name": function["name"], "status": "completed"}
        items.append({"id": f"fc_{uuid.uuid4().hex}", **item, "arguments": function["arguments"]})
    return items


class _ResponseEvents:
    """One streamed response's server-sent events, in OpenAI's order and shapes, numbered (`sequence_number`):
    `response.created` and `.in_progress`; the message item opened (`output_item.added`, `content_part.added`) with
    the first text, then `output_text.delta` per posted piece (with `include` logprobs: its tokens'); at the end the
    text, part and item done, a `function_call` item per parsed call (`function_call_arguments.delta` / `.done`), and
    `response.completed` with the whole response (its `status` may be incomplete), item ids as streamed. With tools
    offered the text is held back to the end, where tool calls are parsed out of it (as the chat stream does)."""

    def __init__(self, ctx: AnswerContext, body: ResponsesRequest, model: str, prompt: list[int]) -> None:
        self.ctx, self.body, self.model, self.prompt = ctx, body, model, prompt
        self.response_id, self.message_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.sequence = 0
        self.opened = False  # the message item and its text part announced
        self.sent = ""  # the text sent in deltas so far

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + dump(payload) + b"\n\n"

    def start(self) -> list[bytes]:
        snapshot = _response(self.ctx, self.body, self.model, self.prompt, None, self.response_id, self.message_id)
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def delta(self, piece: DecodedSample) -> list[bytes]:
        """A posted piece of the sample (its new tokens and text)."""
        if self.ctx.tools or not piece.text:
            return []
        events = self._open()
        self.sent += piece.text
        return events + [self._text_delta(piece.text, chat_logprobs(piece)["content"] if self.ctx.logprobs else [])]

    def finish(self, sample: DecodedSample) -> list[bytes]:
        """The rest, once the whole `sample` is known (`finished_sample`)."""
        response = _response(self.ctx, self.body, self.model, self.prompt, sample, self.response_id, self.message_id)
        events: list[bytes] = []
        for index, item in enumerate(response["output"]):
            if item["type"] == "message":
                part = item["content"][0]
                events += self._open()
                rest = part["text"][len(self.sent) :] if part["text"].startswith(self.sent) else ""
                if rest or (self.ctx.logprobs and not self.sent and part.get("logprobs")):
                    events.append(self._text_delta(rest, part.get("logprobs", []) if not self.sent else []))
                ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
                done = {"text": part["text"], **({"logprobs": part["logprobs"]} if "logprobs" in part else {})}
                events.append(self.event("response.output_text.done", **ids, **done))
                events.append(self.event("response.content_part.done", **ids, part=part))
            else:
                added = {**item, "status": "in_progress", "arguments": ""}
                events.append(self.event("response.output_item.added", output_index=index, item=added))
                ids = {"item_id": item["id"], "output_index": index}
                events.append(self.event("response.function_call_arguments.delta", **ids, delta=item["arguments"]))
                events.append(self.event("response.function_call_arguments.done", **ids, arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        # `response.completed` also when `status` is incomplete: the SDK's accumulator and the Agents SDK take the
        # final response from that event only (`response.incomplete` would leave them without one)
        return events + [self.event("response.completed", response=response)]

    def _open(self) -> list[bytes]:
        if self.opened:
            return []
        self.opened = True
        item = {"id": self.message_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        ids = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [
            self.event("response.output_item.added", output_index=0, item=item),
            self.event("response.content_part.added", **ids, part=part),
        ]

    def _text_delta(self, text: str, logprobs: list[Any]) -> bytes:
        ids = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return self.event("response.output_text.delta", **ids, delta=text, logprobs=logprobs)


async def _streamed(
    serving: OpenAIServing, flow: Any, events: _ResponseEvents, prompt: list[int]
) -> AsyncIterator[bytes]:
    """The event stream of one response (`_ResponseEvents`); a failure after it began is an `error` event."""
    for event in events.start():
        yield event
    try:
        async for kind, payload in flow:
            if kind == "delta":
                for event in events.delta(payload[2]):
                    yield event
                continue
            sample = await serving.off_loop(finished_sample, events.ctx, payload[1], 0, prompt)
            for event in events.finish(sample):
                yield event
    except Exception as exc:  # the request failed after the stream began: said in the stream
        message = str(getattr(exc, "detail", exc))[:500]
        yield events.event("error", code=str(getattr(exc, "status_code", 500)), message=message, param=None)


async def respond(
    serving: OpenAIServing, flows: Flows, body: ResponsesRequest, chat: ChatCompletionRequest, prompt: list[int]
) -> Response:
    """Sample the response (`chat`, `prompt`: `body.chat_prompt`'s, built by the route) and answer it, built off the
    event loop like every whole answer, or streamed as events (`stream`)."""
    ctx = serving.context(chat, logprobs=bool(chat.logprobs), tools=chat.offered_tools())
    if body.stream:
        flow = serving.streamed_flow(flows, chat, ctx, prompt)
        events = _ResponseEvents(ctx, body, serving.model_name, prompt)
        return StreamingResponse(_streamed(serving, flow, events, prompt), media_type=EVENT_STREAM)
    flow, _ = serving.flow(flows, chat, ctx, [prompt])
    groups = await all_groups(flow, 1)
    answer = await serving.off_loop(response_object, ctx, body, serving.model_name, prompt, groups[0])
    return Response(answer, media_type="application/json")
