"""Per-request sampling settings on the serving engine: groups with different temperature / top_k / top_p share one
running engine through transformers' per-request warpers (`per_request_processors`).

Why a module: transformers builds a per-request warper only when the engine's own config sets it to a non-neutral
value; each request then overrides it. So the engine's config holds placeholders (`PLACEHOLDERS`) for the warpers
some request needed so far and neutral values for the rest, and every group carries its own values as request
kwargs. Invariants of `engine_settings`: the engine config (hence its signature) depends only on the warper set,
never on a request's values; a request's kwargs reproduce exactly the warpers `generate()` would build for its
config (top_k 0, "no top-k", becomes the vocabulary size, which masks nothing; the per-request warper would read 0
as 1).
"""

from __future__ import annotations

import copy
from typing import Any

from transformers import GenerationConfig

__all__ = ["PLACEHOLDERS", "engine_settings", "only_temperature", "warpers_needed"]

#: Engine-config values that make transformers build each warper (a temperature other than 1, a top_p under 1; top_k
#: is the vocabulary size); every request overrides them.
PLACEHOLDERS = {"temperature": 0.5, "top_p": 0.5}
_NEUTRAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}


def warpers_needed(config: GenerationConfig, vocab_size: int) -> frozenset[str]:
    """The per-request warpers `config` needs: a temperature other than 1, a top_k under the vocabulary, a top_p
    under 1."""
    needed = set()
    if config.temperature is not None and config.temperature != 1.0:
        needed.add("temperature")
    if config.top_k and config.top_k < vocab_size:
        needed.add("top_k")
    if config.top_p is not None and config.top_p < 1.0:
        needed.add("top_p")
    return frozenset(needed)


def engine_settings(
    config: GenerationConfig, warpers: frozenset[str], vocab_size: int
) -> tuple[GenerationConfig, dict[str, Any]]:
    """(the engine's config, the group's request kwargs) on an engine with `warpers` (a superset of what `config`
    needs): each warper's setting moves to the request, the engine's config gets its placeholder; a warper the engine
    lacks gets the neutral value (the request does not need it)."""
    values = {
        "temperature": float(config.temperature if config.temperature is not None else 1.0),
        "top_k": min(int(config.top_k or vocab_size), vocab_size),
        "top_p": float(config.top_p if config.top_p is not None else 1.0),
    }
    placeholders = {**PLACEHOLDERS, "top_k": vocab_size}
    engine_config = copy.deepcopy(config)
    engine_config.update(**{name: placeholders[name] if name in warpers else _NEUTRAL[name] for name in _NEUTRAL})
    return engine_config, {name: values[name] for name in sorted(warpers)}


def only_temperature(kwargs: dict[str, Any], vocab_size: int) -> bool:
    """Whether a group with these request kwargs was shaped by nothing but temperature (top-k keeps the whole
    vocabulary, top-p 1 keeps every token of non-zero probability): then its processed logprob is
    `log_softmax(logits / T)` itself, which the server reports for both, as an engine without placeholders would
    (`_upstream_sampling.output_logprobs`)."""
    return bool(kwargs) and kwargs.get("top_k", vocab_size) >= vocab_size and kwargs.get("top_p", 1.0) >= 1.0
