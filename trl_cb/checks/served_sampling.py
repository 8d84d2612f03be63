"""The sampling settings a rollout server applies per request: one table, `SERVED_SAMPLING`, read by every side.

Why one table: a served setting crosses five places (the trainer's config check, what the trainer sends its servers,
the three request bodies, the engine's per-request warpers), and each used to spell the set out. Now the request
bodies' fields and bounds (`serving/protocol.py` `ServedSampling`), the trainer's request (`trainers/remote.py`), the
refusal of everything else (`generation_settings.SERVED_FIELDS`) and the per-request warper values
(`serving/request_settings.py`) are all built from the rows here; docs/architecture.md, "How to add", lists the rest.
Invariants: a row's name is the same in `GenerationConfig`, on every wire (OpenAI's, vLLM's, trl_cb's own) and in
transformers' per-request warper kwargs; `off` is the value that changes nothing, and an unset field means `off`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["SERVED_SAMPLING", "ServedSetting", "served_names"]


@dataclass(frozen=True)
class ServedSetting:
    """One served sampling setting. `bounds`: the request field's pydantic constraints (`gt` / `ge` / `le`);
    `placeholder`: the engine-config value that makes transformers build the setting's per-request warper (None: the
    vocabulary size). A `counts_tokens` setting (top-k) is off at 0 or below, and capped at the vocabulary."""

    name: str
    kind: type[int] | type[float]
    off: int | float
    placeholder: int | float | None
    bounds: dict[str, float] = field(default_factory=dict)
    counts_tokens: bool = False

    def request_value(self, value: Any) -> int | float:
        """A request's (or a `GenerationConfig`'s) value as the server applies it: `off` when unset, a token count
        below 0 as 0 (vLLM's -1: every token)."""
        if value is None:
            return self.off
        return max(int(value), 0) if self.counts_tokens else self.kind(value)

    def warper_value(self, value: Any, vocab_size: int) -> int | float:
        """The value transformers' per-request warper takes (a token count: 1..vocab_size, vocab_size when off)."""
        value = self.request_value(value)
        if self.counts_tokens:
            return min(int(value), vocab_size) if value > 0 else vocab_size
        return value

    def warper_off(self, vocab_size: int) -> int | float:
        return vocab_size if self.counts_tokens else self.off

    def engine_placeholder(self, vocab_size: int) -> int | float:
        return vocab_size if self.placeholder is None else self.placeholder


#: The served sampling settings (temperature also has the greedy rule: 0 is served as `protocol.GREEDY`, and anything
#: else must be at least `generation_settings.MIN_SAMPLING_TEMPERATURE`, `protocol.greedy_or_sampling`).
SERVED_SAMPLING: tuple[ServedSetting, ...] = (
    ServedSetting("temperature", float, off=1.0, placeholder=0.5),
    ServedSetting("top_p", float, off=1.0, placeholder=0.5, bounds={"gt": 0.0, "le": 1.0}),
    ServedSetting("top_k", int, off=0, placeholder=None, bounds={"ge": -1}, counts_tokens=True),
)


def served_names() -> str:
    """The served settings in words, for error messages ("temperature, top_p and top_k")."""
    names = [setting.name for setting in SERVED_SAMPLING]
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]
