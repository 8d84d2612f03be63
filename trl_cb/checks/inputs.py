"""Prompts checked before they reach the engine, which would otherwise mangle them silently (docs/index.md, "Bad
input"): an empty prompt samples from a neighbour's logits, an id outside the vocabulary fails every request of the
round, a prompt longer than the cache or the model's positions fails or is cut."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any

from transformers import PreTrainedModel

__all__ = ["check_type", "validate_prompts"]


def check_type(name: str, value: Any, expected: type | tuple[type, ...], optional: bool = False) -> None:
    """`TypeError` naming the argument when `value` is not an `expected` (None allowed when `optional`); a bool is not
    an int here (`True` is no count). Public entry points call it first, so a wrong type never surfaces later as an
    error about something else (`'float' object has no attribute 'bit_length'`)."""
    if value is None and optional:
        return
    kinds = expected if isinstance(expected, tuple) else (expected,)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        names = " or ".join(k.__name__ for k in kinds) + (" or None" if optional else "")
        raise TypeError(f"{name} must be {names}, got {value!r} ({type(value).__name__}).")


def validate_token_ids(name: str, token_ids: Iterable[int], module: PreTrainedModel) -> None:
    """`ValueError` naming `name` if any of `token_ids` (a logit bias's keys, say) is outside the model's vocabulary,
    where the engine could not apply it."""
    vocab_size = module.config.get_text_config().vocab_size
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{name} holds token id {bad}, outside the model's vocabulary [0, {vocab_size}).")


def validate_prompts(
    prompts: list[list[int]],
    module: PreTrainedModel,
    max_new_tokens: int,
    cb_kwargs: dict[str, Any],
    indices: Sequence[int] | None = None,
) -> None:
    """Raise `ValueError` for input the engine would silently mangle (see docs/index.md, "Bad input").

    `indices`: the position of each prompt in the caller's list, for the messages (default: 0, 1, ...)."""
    vocab_size = module.config.get_text_config().vocab_size
    max_positions = getattr(module.config.get_text_config(), "max_position_embeddings", None)
    user_blocks, page_size = cb_kwargs.get("num_blocks"), cb_kwargs.get("page_size")
    for i, prompt in zip(range(len(prompts)) if indices is None else indices, prompts, strict=True):
        if len(prompt) == 0:
            raise ValueError(f"Prompt {i} is empty; continuous batching needs at least one prompt token.")
        if not all(type(token) is int for token in prompt):  # the common case first: an ABC check per token is slow
            for token in prompt:
                if not isinstance(token, numbers.Integral) or isinstance(token, bool):
                    raise ValueError(
                        f"Prompt {i} holds {token!r} ({type(token).__name__}); token ids must be integers."
                    )
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"Prompt {i} holds token id {bad}, outside the model's vocabulary [0, {vocab_size}).")
        total = len(prompt) + max_new_tokens
        if max_positions is not None and total > max_positions:
            raise ValueError(
                f"Prompt {i} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} that is {total} "
                f"positions, beyond the model's max_position_embeddings={max_positions}."
            )
        if user_blocks is not None and page_size is not None and -(-total // page_size) > user_blocks:
            raise ValueError(
                f"Prompt {i} needs {-(-total // page_size)} cache blocks of {page_size} tokens, but num_blocks="
                f"{user_blocks} was set; raise num_blocks or leave it unset to size the cache from the workload."
            )
