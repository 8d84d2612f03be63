"""The sampling settings a rollout server applies per request: one table, `SERVED_SAMPLING`, read by every side.

Why one table: a served setting crosses five places (the trainer's config check, what the trainer sends its servers,
the three request bodies, the engine's per-request warpers), and each used to spell the set out. Now the request
bodies' fields and bounds (`serving/protocol.py` `ServedSampling`), the trainer's request (`trainers/remote.py`), the
refusal of everything else (`generation_settings.SERVED_FIELDS`) and the per-request warper values
(`serving/request_settings.py`) are all built from the rows here; docs/architecture.md, "How to add", lists the rest.
Invariants: a row's name is the same in `GenerationConfig`, in the engine's per-request kwargs and on every wire
(OpenAI's, vLLM's, trl_cb's own; `alias`, vLLM's other spelling, is accepted too); `off` is the value that changes
nothing, and an unset field means `off`. Who applies a row: transformers' per-request warpers (temperature, top-k,
top-p), trl_cb's per-request min-p warper in their place (`_upstream_sampling.PerRequestMinP`), trl_cb's request
processors (penalties, logit bias, min tokens, seeds: `engine/request_processors.py`, `REQUEST_KWARGS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field

__all__ = ["MAX_LOGIT_BIAS", "SERVED_SAMPLING", "ServedSetting", "logit_bias_pairs", "served_names"]

#: Largest |bias| in `logit_bias` (OpenAI's and vLLM's bound), and most entries in one.
MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES = 100.0, 1024


def logit_bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """A `logit_bias` (`{id: bias}`, or pairs) as sorted `(id, bias)` pairs without zero biases: the hashable form
    an engine request carries."""
    pairs = bias.items() if isinstance(bias, dict) else (bias or ())
    return tuple(sorted((int(t), float(b)) for t, b in pairs if float(b) != 0.0))


@dataclass(frozen=True)
class ServedSetting:
    """One served sampling setting. `bounds`: the request field's pydantic constraints (`gt` / `ge` / `le`);
    `placeholder`: the engine-config value that makes the engine build the setting's per-request processor (None: the
    vocabulary size). A `counts_tokens` setting (top-k) is off at 0 or below, and capped at the vocabulary; a
    `token_map` one (logit bias) is `{token id: value}` on the wire and sorted pairs in the engine. `unset_in_engine`:
    the engine builds the processor whenever its field is set, even to `off` (min-p), so an engine without it has
    None there."""

    name: str
    kind: Any
    off: Any
    placeholder: Any
    bounds: dict[str, float] = field(default_factory=dict)
    counts_tokens: bool = False
    token_map: bool = False
    alias: str | None = None
    unset_in_engine: bool = False

    def request_value(self, value: Any) -> Any:
        """A request's (or a `GenerationConfig`'s) value as the server applies it: `off` when unset, a token count
        below 0 as 0 (vLLM's -1: every token), a token map as sorted pairs."""
        if value is None:
            return self.off
        if self.token_map:
            return logit_bias_pairs(value)
        return max(int(value), 0) if self.counts_tokens else self.kind(value)

    def wire_value(self, value: Any) -> Any:
        """`request_value` as a JSON body carries it (a token map as `{"id": value}`)."""
        value = self.request_value(value)
        return {str(t): b for t, b in value} if self.token_map else value

    def warper_value(self, value: Any, vocab_size: int) -> Any:
        """The value the engine's per-request processor takes (a token count: 1..vocab_size, vocab_size when off)."""
        value = self.request_value(value)
        if self.counts_tokens:
            return min(int(value), vocab_size) if value > 0 else vocab_size
        return value

    def warper_off(self, vocab_size: int) -> Any:
        return vocab_size if self.counts_tokens else self.off

    def engine_placeholder(self, vocab_size: int) -> Any:
        return vocab_size if self.placeholder is None else self.placeholder

    def engine_off(self) -> Any:
        """The engine config's value where no request needs the processor."""
        return None if self.unset_in_engine else self.off


_Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]

#: The served sampling settings (temperature also has the greedy rule: 0 is served as `protocol.GREEDY`, and anything
#: else must be at least `generation_settings.MIN_SAMPLING_TEMPERATURE`, `protocol.greedy_or_sampling`).
SERVED_SAMPLING: tuple[ServedSetting, ...] = (
    ServedSetting("temperature", float, off=1.0, placeholder=0.5),
    ServedSetting("top_p", float, off=1.0, placeholder=0.5, bounds={"gt": 0.0, "le": 1.0}),
    ServedSetting("top_k", int, off=0, placeholder=None, bounds={"ge": -1}, counts_tokens=True),
    ServedSetting("min_p", float, off=0.0, placeholder=0.5, bounds={"ge": 0.0, "le": 1.0}, unset_in_engine=True),
    ServedSetting("repetition_penalty", float, off=1.0, placeholder=2.0, bounds={"gt": 0.0, "le": 100.0}),
    ServedSetting("presence_penalty", float, off=0.0, placeholder=0.5, bounds={"ge": -2.0, "le": 2.0}),
    ServedSetting("frequency_penalty", float, off=0.0, placeholder=0.5, bounds={"ge": -2.0, "le": 2.0}),
    ServedSetting(
        "logit_bias",
        dict[Annotated[int, Field(ge=0)], _Bias],
        off=(),
        placeholder=((0, 1.0),),
        bounds={"max_length": MAX_LOGIT_BIAS_ENTRIES},
        token_map=True,
    ),  # fmt: skip
    ServedSetting("min_new_tokens", int, off=0, placeholder=1, bounds={"ge": 0}, alias="min_tokens"),
    ServedSetting("seed", int, off=-1, placeholder=0, bounds={"ge": -1, "le": 2**63 - 1}),  # -1: unseeded
)


def served_names() -> str:
    """The served settings in words, for error messages ("temperature, top_p and top_k")."""
    names = [setting.name for setting in SERVED_SAMPLING]
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]
