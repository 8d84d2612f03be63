"""The offline model's name, the same wherever a model name is accepted (the CLI, the example scripts, their
defaults): it builds the tiny random model locally instead of downloading anything."""

from __future__ import annotations

__all__ = ["TINY_MODEL", "is_tiny_model_name"]

TINY_MODEL = "trl-cb/tiny"
#: Also accepted: the spelling the example scripts used before (`--model_name_or_path tiny`).
_TINY_MODEL_NAMES = (TINY_MODEL, "tiny")


def is_tiny_model_name(name: str | None) -> bool:
    """Whether `name` asks for the offline tiny model."""
    return name in _TINY_MODEL_NAMES
