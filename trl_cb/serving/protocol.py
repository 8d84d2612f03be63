"""Request and response bodies of the rollout server's HTTP API (docs/server.md), and the limits it enforces.

A request outside the limits is refused with HTTP 422 naming the field and the limit, before anything reaches the
engine; the prompts' content (empty, ids outside the vocabulary, past the model's positions) is checked by the server
with `checks.inputs.validate_prompts`, the rule every trl_cb generation applies, which answers 400.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

#: Most prompts one completion request may carry.
MAX_PROMPTS = 1024
#: Most samples per prompt.
MAX_N = 64
#: Most new tokens per sample.
MAX_TOKENS = 8192
#: Longest prompt, in tokens.
MAX_PROMPT_TOKENS = 32768
#: One token-id prompt, at most `MAX_PROMPT_TOKENS` long.
PromptIds = Annotated[list[int], Field(max_length=MAX_PROMPT_TOKENS)]


class CompletionRequest(BaseModel):
    """OpenAI `/v1/completions` for token-id prompts; `n` samples per prompt, each sampled with trl_cb's engine."""

    model: str | None = None
    prompt: list[PromptIds] = Field(min_length=1, max_length=MAX_PROMPTS)
    n: int = Field(default=1, ge=1, le=MAX_N)
    max_tokens: int = Field(ge=1, le=MAX_TOKENS)
    temperature: float = Field(default=1.0, gt=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=0)  # only the sampled token's logprob is returned
    return_token_ids: bool = True


class Choice(BaseModel):
    """One completion: sample `index % n` of prompt `prompt_index` (`index = prompt_index * n + sample`)."""

    index: int
    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    policy_logprobs: list[float]
    weight_version: int  # the oldest token's (the version the completion started with)
    token_weight_versions: list[int] = Field(default_factory=list)  # per token: the weights that sampled it
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    model: str
    choices: list[Choice]
    usage: dict[str, int]


class WeightsInit(BaseModel):
    """Join the trainer's weight-sync group: a TCPStore at `host:port` (the trainer is its master, rank 0)."""

    host: str
    port: int = Field(ge=1, le=65535)
    token: str = Field(min_length=8, max_length=256)
    timeout_s: float = Field(default=60.0, gt=0.0, le=3600.0)


class WeightsUpdate(BaseModel):
    """Receive `params` (name, dtype, shape), broadcast by rank 0 in this order, then serve weight `version`."""

    token: str
    version: int = Field(ge=1)
    params: list[tuple[str, str, list[int]]]


class WeightsClose(BaseModel):
    token: str
