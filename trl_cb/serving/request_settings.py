"""Per-request sampling settings on the serving engine: groups with different temperature / top_k / top_p share one
running engine through transformers' per-request warpers (`per_request_processors`).

Why a module: transformers builds a per-request warper only when the engine's own config sets it to a non-neutral
value; each request then overrides it. So the engine's config holds placeholders (`ServedSetting.placeholder`) for the
warpers some request needed so far and neutral values for the rest, and every group carries its own values as request
kwargs. Invariants of `engine_settings`: the engine config (hence its signature) depends only on the warper set, never
on a request's values; a request's kwargs reproduce exactly the warpers `generate()` would build for its config (top_k
0, "no top-k", becomes the vocabulary size, which masks nothing; the per-request warper would read 0 as 1).
"""

from __future__ import annotations

import copy
from typing import Any

from transformers import GenerationConfig

from ..checks.served_sampling import SERVED_SAMPLING, ServedSetting

__all__ = ["PER_REQUEST", "engine_settings", "only_temperature", "warpers_needed"]

#: Everything a request may carry to the engine: the served sampling settings, and what the engine records for it
#: without changing the distribution (`top_logprobs`, asked on the wire as OpenAI's `logprobs: k` / `top_logprobs`).
PER_REQUEST: tuple[ServedSetting, ...] = (*SERVED_SAMPLING, ServedSetting("top_logprobs", int, off=0, placeholder=1))


def warpers_needed(config: GenerationConfig, vocab_size: int) -> frozenset[str]:
    """The per-request warpers `config` needs: each served setting (`SERVED_SAMPLING`) whose warper value is not off
    (a temperature other than 1, a top_k under the vocabulary, a top_p under 1)."""
    return frozenset(
        setting.name
        for setting in PER_REQUEST
        if setting.warper_value(getattr(config, setting.name, None), vocab_size) != setting.warper_off(vocab_size)
    )


def engine_settings(
    config: GenerationConfig, warpers: frozenset[str], vocab_size: int
) -> tuple[GenerationConfig, dict[str, Any]]:
    """(the engine's config, the group's request kwargs) on an engine with `warpers` (a superset of what `config`
    needs): each warper's setting moves to the request, the engine's config gets its placeholder; a warper the engine
    lacks gets the off value (the request does not need it)."""
    engine_config = copy.deepcopy(config)
    for s in PER_REQUEST:  # setattr, not `update()`: OpenAI's fields are extra attributes `update()` skips
        setattr(engine_config, s.name, s.engine_placeholder(vocab_size) if s.name in warpers else s.engine_off())
    kwargs = {s.name: s.warper_value(getattr(config, s.name, None), vocab_size) for s in PER_REQUEST}
    return engine_config, {name: kwargs[name] for name in sorted(warpers)}


def only_temperature(kwargs: dict[str, Any], vocab_size: int) -> bool:
    """Whether a group with these request kwargs was shaped by nothing but temperature (every other served setting
    off: top-k keeps the whole vocabulary, top-p 1 keeps every token of non-zero probability): then its processed
    logprob is `log_softmax(logits / T)` itself, which the server reports for both, as an engine without placeholders
    would (`_upstream_sampling.output_logprobs`)."""
    off = {s.name: s.warper_off(vocab_size) for s in PER_REQUEST if s.name != "temperature"}
    return bool(kwargs) and all(kwargs.get(name, value) == value for name, value in off.items())
