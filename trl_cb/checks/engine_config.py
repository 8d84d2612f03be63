"""The continuous-batching engine settings a user gives (`ContinuousBatchingConfig` or its kwargs), checked once.

Rules kept here and asked for by the configs, the generator and the trainers: only keys `ContinuousBatchingConfig`
accepts; `max_memory_percent` in (0, 1], `DEFAULT_MAX_MEMORY_PERCENT` when unset (transformers would otherwise size
the cache from most of free memory); generation settings that need trl_cb's per-request processors refuse engine
settings that make the engine asynchronous (`engine.request_processors.require_synchronous_engine`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import GenerationConfig
from transformers.generation import ContinuousBatchingConfig

from ..engine.request_processors import require_synchronous_engine
from .generation_settings import engine_generation_config, request_processor_settings

__all__ = [
    "DEFAULT_MAX_MEMORY_PERCENT",
    "cb_kwargs",
    "check_engine_settings",
    "valid_cb_keys",
    "validate_cb_kwargs",
    "validate_generation_settings",
]

#: Share of free memory the engine's cache may take when the user sets no `max_memory_percent`.
DEFAULT_MAX_MEMORY_PERCENT = 0.5


def valid_cb_keys() -> list[str]:
    """Keyword arguments `ContinuousBatchingConfig` accepts."""
    return sorted(f.name for f in dataclasses.fields(ContinuousBatchingConfig))


def validate_cb_kwargs(kwargs: dict[str, Any]) -> None:
    """`ValueError` for an unknown key or a `max_memory_percent` outside (0, 1]."""
    unknown = sorted(set(kwargs) - set(valid_cb_keys()))
    if unknown:
        raise ValueError(
            f"Unknown continuous batching config key(s) {unknown}. Valid keys: {', '.join(valid_cb_keys())}."
        )
    mmp = kwargs.get("max_memory_percent")
    if mmp is not None and not (0 < float(mmp) <= 1):
        raise ValueError(f"max_memory_percent must be in (0, 1], got {mmp}.")


def cb_kwargs(config: ContinuousBatchingConfig | dict[str, Any] | None) -> dict[str, Any]:
    """The user's engine settings as checked kwargs: what differs from the defaults (for a config object), with
    `max_memory_percent` set (`DEFAULT_MAX_MEMORY_PERCENT` when unset or `None`)."""
    if config is None:
        kwargs: dict[str, Any] = {}
    elif isinstance(config, ContinuousBatchingConfig):
        defaults = ContinuousBatchingConfig()
        kwargs = {
            f.name: getattr(config, f.name)
            for f in dataclasses.fields(config)
            if getattr(config, f.name) != getattr(defaults, f.name)
        }
    else:
        kwargs = dict(config)
    validate_cb_kwargs(kwargs)
    if kwargs.get("max_memory_percent") is None:
        kwargs["max_memory_percent"] = DEFAULT_MAX_MEMORY_PERCENT
    return kwargs


def check_engine_settings(kwargs: dict[str, Any], generation_config: GenerationConfig) -> None:
    """`ValueError` for engine settings under which trl_cb's per-request processors, needed by `generation_config`,
    cannot run exactly (before any engine is built)."""
    if request_processor_settings(generation_config).needs_history:
        require_synchronous_engine(kwargs)


def validate_generation_settings(
    generation_config: GenerationConfig, continuous_batching_config: ContinuousBatchingConfig | dict[str, Any] | None
) -> None:
    """`ValueError` for settings the CB path would not apply exactly — what `ContinuousBatchingGenerator` refuses at
    construction, for callers (the trainers) that want the error before any model work."""
    check_engine_settings(cb_kwargs(continuous_batching_config), engine_generation_config(generation_config))
