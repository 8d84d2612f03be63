"""Request and response bodies of the rollout server's HTTP API (docs/server.md), and the limits it enforces.

A request outside the limits is refused with HTTP 422 naming the field and the limit (never echoing the value),
before anything reaches the engine: non-finite numbers, a temperature under `MIN_SAMPLING_TEMPERATURE`, unknown
fields, and sampling settings the server does not apply (`settings_servers_cannot_apply`, the rule the trainer
applies too). The prompts' content (empty, ids outside the vocabulary, past the model's positions) is checked by the
server with `checks.inputs.validate_prompts`, the rule every trl_cb generation applies, which answers 400. Client and
server build and read bodies from these models.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..checks.generation_settings import FIELD_RULES, MIN_SAMPLING_TEMPERATURE, settings_servers_cannot_apply

#: Most prompts one completion request may carry.
MAX_PROMPTS = 1024
#: Most samples per prompt.
MAX_N = 64
#: Most new tokens per sample.
MAX_TOKENS = 8192
#: Longest prompt, in tokens.
MAX_PROMPT_TOKENS = 32768
#: Default `--max-body-bytes`: the largest request body read (413 past it, counted while reading). 16 MiB holds ~3M
#: token ids as JSON (e.g. 1,024 prompts of 2,500 tokens); weight pushes send only names and shapes over HTTP.
DEFAULT_MAX_BODY_BYTES = 16 * 2**20
#: One token-id prompt, at most `MAX_PROMPT_TOKENS` long.
PromptIds = Annotated[list[int], Field(max_length=MAX_PROMPT_TOKENS)]


class _Strict(BaseModel):
    """Unknown fields are refused (422), not ignored; numbers must be finite."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class CompletionRequest(_Strict):
    """OpenAI `/v1/completions` for token-id prompts; `n` samples per prompt, each sampled with trl_cb's engine."""

    model: str | None = None
    prompt: list[PromptIds] = Field(min_length=1, max_length=MAX_PROMPTS)
    n: int = Field(default=1, ge=1, le=MAX_N)
    max_tokens: int = Field(ge=1, le=MAX_TOKENS)
    temperature: float = Field(default=1.0, ge=MIN_SAMPLING_TEMPERATURE)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=0)  # only the sampled token's logprob is returned
    return_token_ids: bool = True
    #: How choices carry their per-token arrays: JSON lists (OpenAI-style clients), or `packed` (`PackedChoice`:
    #: base64 of little-endian arrays, ~20x cheaper to encode and decode at 8k-token completions).
    encoding: Literal["json", "packed"] = "json"

    @model_validator(mode="before")
    @classmethod
    def _sampling_settings_the_server_applies(cls, data: Any) -> Any:
        """A `GenerationConfig` sampling field the API does not carry: refused when set (naming it), dropped when
        off; anything else unknown is left for `extra="forbid"`."""
        if not isinstance(data, dict):
            return data
        settings = {k: v for k, v in data.items() if k not in cls.model_fields and k in FIELD_RULES}
        refused = settings_servers_cannot_apply(settings)
        if refused:
            raise ValueError(
                f"{refused}: sampling settings this server cannot apply (it samples with temperature, top_p and "
                "top_k); unset them or generate in-process"
            )
        return {k: v for k, v in data.items() if k not in settings}


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


#: The per-token arrays of a `PackedChoice` and their dtypes (little-endian; values round-trip exactly: ids and
#: versions are int32, logprobs are the engine's fp32).
PACKED_ARRAYS = {"token_ids": "<i4", "logprobs": "<f4", "policy_logprobs": "<f4", "token_weight_versions": "<i4"}


class PackedChoice(BaseModel):
    """A `Choice` whose per-token arrays are base64 strings of `PACKED_ARRAYS` dtypes (`encoding="packed"`)."""

    index: int
    prompt_index: int
    token_ids: str
    logprobs: str
    policy_logprobs: str
    weight_version: int
    token_weight_versions: str
    finish_reason: str | None = None

    @classmethod
    def pack(cls, arrays: dict[str, list], **fields: Any) -> PackedChoice:
        """From the per-token lists (`PACKED_ARRAYS` names) and the scalar fields."""
        packed = {
            name: base64.b64encode(np.asarray(arrays[name], dtype=dtype).tobytes()).decode("ascii")
            for name, dtype in PACKED_ARRAYS.items()
        }
        return cls(**packed, **fields)

    def unpack(self) -> Choice:
        """The `Choice` it packs; `ValueError` for arrays that are not base64 of whole elements of equal length."""
        arrays = {}
        for name, dtype in PACKED_ARRAYS.items():
            raw = base64.b64decode(getattr(self, name), validate=True)
            arrays[name] = np.frombuffer(raw, dtype=dtype).tolist()  # ValueError on a partial element
        if len({len(values) for values in arrays.values()}) != 1:
            raise ValueError(f"choice {self.index}: per-token arrays of different lengths")
        scalars = {"index": self.index, "prompt_index": self.prompt_index, "weight_version": self.weight_version}
        return Choice.model_construct(**arrays, **scalars, finish_reason=self.finish_reason)  # values checked above


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    model: str
    choices: list[Choice]
    usage: dict[str, int]


class PackedCompletionResponse(BaseModel):
    """`CompletionResponse` of a request with `encoding="packed"`."""

    id: str
    object: str = "text_completion"
    model: str
    choices: list[PackedChoice]
    usage: dict[str, int]


class StreamLine(BaseModel):
    """One line of `/v1/completions/stream`: a finished group (`prompt_index`, its `n` choices), or an error that
    ends the stream (`error`, with the HTTP `status` the request would have had)."""

    prompt_index: int | None = None
    choices: list[Choice] = Field(default_factory=list)
    error: str | None = None
    status: int | None = None


class PackedStreamLine(StreamLine):
    """`StreamLine` of a request with `encoding="packed"`."""

    choices: list[PackedChoice] = Field(default_factory=list)


class WeightsInit(_Strict):
    """Join the trainer's weight-sync group: a TCPStore at `host:port` (the trainer is its master, rank 0)."""

    host: str
    port: int = Field(ge=1, le=65535)
    token: str = Field(min_length=8, max_length=256)
    timeout_s: float = Field(default=60.0, gt=0.0, le=3600.0)


class WeightsUpdate(_Strict):
    """Receive `params` (name, dtype, shape), broadcast by rank 0 in this order, then serve weight `version`, which
    must be above every version this owner announced before (else 409)."""

    token: str
    version: int = Field(ge=1)
    params: list[tuple[str, str, list[int]]]


class WeightsWait(_Strict):
    """Wait up to `timeout_s` for the outcome of this owner's update to `version`: 200 served, 400 refused (e.g.
    non-finite weights), 500 failed, 404 never announced, 202 still receiving (ask again)."""

    token: str
    version: int = Field(ge=1)
    timeout_s: float = Field(default=30.0, gt=0.0, le=300.0)


class WeightsWaitResponse(BaseModel):
    status: str  # "applied" or "pending"
    weight_version: int  # the version the server serves now


class WeightsClose(_Strict):
    token: str
