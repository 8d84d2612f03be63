"""Request and response bodies of the rollout server's HTTP API (docs/server.md), and the limits it enforces.

A request outside the limits is refused with HTTP 422 naming the field and the limit (never echoing the value),
before anything reaches the engine: non-finite numbers, a temperature under `MIN_SAMPLING_TEMPERATURE` (OpenAI's
routes: other than 0, greedy), unknown
fields, and sampling settings the server does not apply (`settings_servers_cannot_apply`, the rule the trainer
applies too). The prompts' content (empty, ids outside the vocabulary, past the model's positions) is checked by the
server with `checks.inputs.validate_prompts`, the rule every trl_cb generation applies, which answers 400. Client and
server build and read bodies from these models.
"""

from __future__ import annotations

import bisect
import re
import struct
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from ..checks.generation_settings import FIELD_RULES, MIN_SAMPLING_TEMPERATURE, settings_servers_cannot_apply
from ..checks.served_sampling import SERVED_SAMPLING, ServedSetting, served_names

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


#: Numeric sampling fields of every request body (OpenAI's, vLLM's, `GenerationConfig`'s): a number sent as a string
#: (`"0.7"`, from a CLI or a YAML file) is read as that number before any check (`numbers_from_strings`).
NUMERIC_FIELDS = frozenset(
    {"temperature", "top_p", "top_k", "min_p", "typical_p", "top_h", "epsilon_cutoff", "eta_cutoff", "n", "seed",
     "max_tokens", "max_completion_tokens", "max_new_tokens", "min_tokens", "min_new_tokens", "min_length",
     "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "best_of",
     "prompt_logprobs"}
)  # fmt: skip
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)


def numbers_from_strings(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with each `NUMERIC_FIELDS` value that is a decimal number written as a string turned into that number
    (an int when it has no fraction or exponent), so that every check sees the same value whichever way it was sent
    (`"0.0"` is off like `0.0`); other strings are left for the checks to refuse (422)."""
    out = dict(data)
    for name in NUMERIC_FIELDS & out.keys():
        value = out[name]
        if isinstance(value, str) and len(value) <= 64 and _NUMBER.fullmatch(value.strip()):
            text = value.strip()
            out[name] = int(text) if text.lstrip("+-").isdigit() else float(text)
    return out


#: What `temperature: 0` (greedy: evaluations and agent loops send it) is served as: the top-1 token at temperature 1,
#: exactly the argmax; its `logprobs` are 0 (the sampled distribution is one token), its `policy_logprobs` the
#: trainer's `log_softmax(logits)`.
GREEDY = {"temperature": 1.0, "top_p": 1.0, "top_k": 1}


def greedy_or_sampling(temperature: float | None) -> float | None:
    """Field check of a request's temperature: 0 (greedy) or at least `MIN_SAMPLING_TEMPERATURE`."""
    if temperature is not None and temperature != 0 and not temperature >= MIN_SAMPLING_TEMPERATURE:
        raise ValueError(
            f"temperature must be 0 (greedy) or >= {MIN_SAMPLING_TEMPERATURE}: below it the fp32 logits divided by "
            "it overflow"
        )
    return temperature


class SamplingRequest(_Strict):
    """A request that samples: numbers sent as strings are read as numbers first (`numbers_from_strings`, for every
    numeric sampling field alike); `GenerationConfig` sampling fields it does not carry are refused (see below)."""

    @model_validator(mode="before")
    @classmethod
    def _sampling_settings_the_server_applies(cls, data: Any) -> Any:
        """A `GenerationConfig` sampling field the API does not carry: refused when set (naming it), dropped when
        off; anything else unknown is left for `extra="forbid"`."""
        if not isinstance(data, dict):
            return data
        data = numbers_from_strings(data)
        settings = {k: v for k, v in data.items() if k not in cls.model_fields and k in FIELD_RULES}
        refused = settings_servers_cannot_apply(settings)
        if refused:
            raise ValueError(
                f"{refused}: sampling settings this server cannot apply (it samples with {served_names()}); unset "
                "them or generate in-process"
            )
        return {k: v for k, v in data.items() if k not in settings}


class _ServedSamplingRules(SamplingRequest):
    """The rules and the reading of the served fields that `ServedSampling` adds from the table."""

    @field_validator("temperature", check_fields=False)
    @classmethod
    def _greedy_or_sampling(cls, temperature: float | None) -> float | None:
        return greedy_or_sampling(temperature)

    def sampling(self) -> dict[str, Any]:
        """The engine's sampling settings of this request: each served setting's value (`off` when unset), with
        `GREEDY`'s for temperature 0 (penalties and biases still apply first: greedy over the penalised logits)."""
        values = {s.name: s.request_value(getattr(self, s.name)) for s in SERVED_SAMPLING}
        return {**values, **GREEDY} if values["temperature"] == 0 else values


def _served_field(setting: ServedSetting) -> Any:
    """A row's request field: unset (None) by default, within the row's bounds, also read under its `alias`."""
    alias = AliasChoices(setting.name, setting.alias) if setting.alias else None
    return Field(default=None, validation_alias=alias, **setting.bounds)


#: Every request body's served sampling fields, one per `SERVED_SAMPLING` row (unset: off; the row's bounds, 422
#: past them), built from the table so that a new row reaches every route; `sampling()` reads them for the engine.
ServedSampling = create_model(
    "ServedSampling",
    __base__=_ServedSamplingRules,
    __module__=__name__,
    **{s.name: (s.kind | None, _served_field(s)) for s in SERVED_SAMPLING},  # type: ignore[call-overload]
)


#: The key of `sampling()` that asks for a sample that EOS does not end (the engine request gets no EOS id).
IGNORE_EOS = "ignore_eos"

#: Most stop strings per request, and their longest length (characters); most stop token ids (vLLM's).
MAX_STOPS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 256, 256
Stop = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class DecodedSamplingRequest(ServedSampling):  # type: ignore[misc,valid-type]
    """A request whose samples are decoded and may end at a stop (OpenAI's completion and chat bodies, vLLM's
    `sampling_params`; answered by `openai_serving.py`): the served sampling fields and the stop fields its decoder
    reads."""

    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOPS)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False  # vLLM's: EOS does not end the sample (it may still be sampled)

    @model_validator(mode="after")
    def _stops_after_min_tokens(self) -> DecodedSamplingRequest:
        if self.min_new_tokens and self.stop_token_ids:
            raise ValueError(
                "min_tokens with stop_token_ids: the server holds back EOS for min_tokens, not stop_token_ids "
                "(vLLM holds back both); send one of them"
            )
        return self

    def sampling(self) -> dict[str, Any]:
        """`ServedSampling.sampling()`, with `IGNORE_EOS: True` where the request set `ignore_eos`."""
        return {**super().sampling(), **({IGNORE_EOS: True} if self.ignore_eos else {})}

    def stops(self) -> list[str]:
        """The stop strings as one list (the request may send one string, a list, or none)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(ServedSampling):  # type: ignore[misc,valid-type]
    """`/v1/completions` for token-id prompts as trl_cb's client sends it; `n` samples per prompt, each sampled with
    trl_cb's engine. The route reads the OpenAI superset (`openai_protocol.OpenAICompletionRequest`)."""

    model: str | None = None
    prompt: list[PromptIds] = Field(min_length=1, max_length=MAX_PROMPTS)
    n: int = Field(default=1, ge=1, le=MAX_N)
    max_tokens: int = Field(ge=1, le=MAX_TOKENS)
    logprobs: int | None = Field(default=None, ge=0, le=0)  # only the sampled token's logprob is returned
    return_token_ids: bool = True
    #: How choices carry their per-token arrays: JSON (OpenAI's objects, `openai_answers.py`), or `binary` (no JSON
    #: body at all: length-prefixed frames of raw little-endian arrays, `frames.py`, media type `FRAMES_MEDIA_TYPE`).
    encoding: Literal["json", "binary"] = "json"
    detokenize: bool = True  # JSON answers: false leaves `text` empty (trl_cb's client reads token ids only)


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


def value_runs(values: list[int]) -> tuple[list[int], list[int]]:
    """`(run values, run lengths)` of the runs of equal values in `values`. A completion's per-token versions change
    only at weight updates (a few runs, nondecreasing), so each run's end is found by bisection and then checked
    (one C-level `count`); a list that is not nondecreasing still gets exact runs, found one element at a time."""
    run_values, run_lengths = [], []
    i, end = 0, len(values)
    while i < end:
        value = values[i]
        j = bisect.bisect_right(values, value, i)  # the run's end if `values` is nondecreasing
        if values[i:j].count(value) != j - i:
            j = i + 1
            while j < end and values[j] == value:
                j += 1
        run_values.append(value)
        run_lengths.append(j - i)
        i = j
    return run_values, run_lengths


@dataclass
class PackedColumns:
    """The server's side of a binary answer's choices (`frames.py`): choices appended one at a time (`add`), each
    per-token array packed to little-endian bytes once (`struct`, no per-token Python objects kept). Policy logprobs
    equal to the logprobs (the engine's only-temperature case) are sent once."""

    index: list[int] = field(default_factory=list)
    prompt_index: list[int] = field(default_factory=list)
    weight_version: list[int] = field(default_factory=list)
    finish_reason: list[str | None] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    version_runs: list[int] = field(default_factory=list)
    version_values: list[int] = field(default_factory=list)
    version_lengths: list[int] = field(default_factory=list)
    token_ids: list[bytes] = field(default_factory=list)  # per choice: int32 bytes
    logprobs: list[bytes] = field(default_factory=list)  # per choice: fp32 bytes
    policy_logprobs: list[bytes] = field(default_factory=list)  # per choice: fp32 bytes, `logprobs[k]` itself if equal

    def add(
        self,
        token_ids: list[int],
        logprobs: list[float],
        policy_logprobs: list[float],
        version_runs: tuple[list[int], list[int]],
        **scalars: Any,
    ) -> None:
        """One choice: its per-token lists, its per-token versions as `value_runs`, and `index`, `prompt_index`,
        `weight_version`, `finish_reason`."""
        n = len(token_ids)
        run_values, run_lengths = version_runs
        if not len(logprobs) == len(policy_logprobs) == sum(run_lengths) == n:
            raise ValueError(f"choice {scalars.get('index')}: per-token arrays of different lengths")
        for name in ("index", "prompt_index", "weight_version", "finish_reason"):
            getattr(self, name).append(scalars[name])
        packed = struct.pack(f"<{n}f", *logprobs)
        same = policy_logprobs is logprobs or policy_logprobs == logprobs  # identical objects: a pointer compare each
        self.num_tokens.append(n)
        self.token_ids.append(struct.pack(f"<{n}i", *token_ids))
        self.logprobs.append(packed)
        self.policy_logprobs.append(packed if same else struct.pack(f"<{n}f", *policy_logprobs))
        self.version_runs.append(len(run_values))
        self.version_values += run_values
        self.version_lengths += run_lengths

    def extend(self, other: PackedColumns) -> None:
        for name in self.__dataclass_fields__:
            getattr(self, name).extend(getattr(other, name))

    def scalars(self) -> dict[str, list[Any]]:
        """The per-choice columns (`ChoiceColumns`' fields)."""
        return {name: getattr(self, name) for name in ChoiceColumns.model_fields}

    def policy_sent(self) -> bool:
        """Whether the policy logprobs differ from the logprobs somewhere (else they are not sent)."""
        return not all(p is lp for p, lp in zip(self.policy_logprobs, self.logprobs))


class ChoiceColumns(BaseModel):
    """The per-choice columns of an answer whose per-token arrays travel as buffers (binary frames, `frames.py`):
    choice c's tokens come right after choice c-1's (`num_tokens[c]` of them); its per-token weight versions are
    `version_runs[c]` runs of `version_values` / `version_lengths`. `checked_total` checks that they fit together."""

    index: list[int]
    prompt_index: list[int]
    weight_version: list[int]
    finish_reason: list[str | None]
    num_tokens: list[Annotated[int, Field(ge=0)]]
    version_runs: list[Annotated[int, Field(ge=0)]]
    version_values: list[int]
    version_lengths: list[Annotated[int, Field(ge=1)]]

    def versions(self) -> set[int]:
        """Every weight version the choices carry (a choice's own and its tokens')."""
        return set(self.weight_version) | set(self.version_values)

    def checked_total(self) -> int:
        """The total token count; `ValueError` naming the field for columns of different lengths or run counts that
        do not match the runs."""
        count = len(self.index)
        for name in ("prompt_index", "weight_version", "finish_reason", "num_tokens", "version_runs"):
            if len(getattr(self, name)) != count:
                raise ValueError(f"packed choices: {name} has {len(getattr(self, name))} entries for {count} choices")
        if len(self.version_values) != len(self.version_lengths) or len(self.version_values) != sum(self.version_runs):
            raise ValueError(
                f"packed choices: {len(self.version_values)} version values and {len(self.version_lengths)} lengths "
                f"for {sum(self.version_runs)} runs"
            )
        return sum(self.num_tokens)

    def check_runs(self) -> None:
        """`ValueError` unless each choice's version runs cover exactly its tokens (after `checked_total`)."""
        first_run = 0
        for c, (tokens, runs) in enumerate(zip(self.num_tokens, self.version_runs)):
            covered = sum(self.version_lengths[first_run : first_run + runs])
            if covered != tokens:
                raise ValueError(f"packed choices: choice {c}'s version runs cover {covered} of its {tokens} tokens")
            first_run += runs


class CompletionResponse(BaseModel):  # the JSON answer before OpenAI's (`openai_answers.py`): a benchmark's baseline
    id: str
    object: str = "text_completion"
    model: str
    choices: list[Choice]
    usage: dict[str, int]


class StreamLine(BaseModel):
    """One line of `/v1/completions/stream`: a finished group (`prompt_index`, its `n` choices), or an error that
    ends the stream (`error`, with the HTTP `status` the request would have had)."""

    prompt_index: int | None = None
    choices: list[Choice] = Field(default_factory=list)
    error: str | None = None
    status: int | None = None


class FrameChoices(ChoiceColumns):
    """The columns of a binary frame's choices; its arrays follow the header (`frames.py`)."""

    policy_logprobs_sent: bool  # false: the policy logprobs equal the logprobs and are not in the frame


class FrameHeader(BaseModel):
    """The JSON header of one binary frame (`encoding="binary"`, `frames.py`): a `/v1/completions` answer (`id`,
    `model`, `usage`, `choices`), a stream's group (`prompt_index`, `choices`), or a stream's error (`error`,
    `status`: the HTTP status the request would have had), which ends it."""

    id: str | None = None
    object: str | None = None
    model: str | None = None
    usage: dict[str, int] | None = None
    prompt_index: int | None = None
    choices: FrameChoices | None = None
    error: str | None = None
    status: int | None = None


class WeightsInit(_Strict):
    """Join the trainer's weight-sync group: a TCPStore at `host:port` (the trainer is its master, rank 0)."""

    host: str
    port: int = Field(ge=1, le=65535)
    token: str = Field(min_length=8, max_length=256)
    timeout_s: float = Field(default=60.0, gt=0.0, le=3600.0)


class WeightsUpdate(_Strict):
    """Receive `params` (name, dtype, shape), broadcast by rank 0 in this order, then serve weight `version`, which
    must be above every version this owner announced before (else 409). The tensors travel packed in flat buffers of
    up to `bucket_bytes` (`weight_buckets.py`; 0: one broadcast per tensor)."""

    token: str
    version: int = Field(ge=1)
    params: list[tuple[str, str, list[int]]]
    bucket_bytes: int = Field(default=0, ge=0)


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
