"""Silence transformers' `gradient_checkpointing` deprecation warnings that TRL's own code raises, where trl_cb calls
TRL — and nowhere else.

Why: transformers 5.x renamed gradient checkpointing to activation checkpointing and warns (FutureWarning) on every
use of the old names. TRL 1.16 still uses them: its configs declare `gradient_checkpointing=True` as a default
(transformers' `TrainingArguments.__post_init__` warns once per config), and `unwrap_model_for_generation` /
`disable_gradient_checkpointing` call `is_gradient_checkpointing`, `gradient_checkpointing_disable` and
`gradient_checkpointing_enable` (several warnings per training step); PEFT's `get_peft_model`, which TRL's trainers
call for a `peft_config`, reads `is_gradient_checkpointing`. None of it is the user's doing, and a user cannot act
on it.

Guarantees:
- Only those four messages, only `FutureWarning`, only when raised from `transformers.training_args` /
  `transformers.modeling_utils`, and only inside the `with` block (`warnings.catch_warnings`): a user's own use of
  the old names elsewhere still warns, and so does a `gradient_checkpointing` value the user changed from TRL's
  default.
- Call sites: the configs' call into TRL's `__post_init__` (`trl_config_post_init`), and the trainers' calls into
  TRL's `__init__` (PEFT's LoRA wrapping reads `is_gradient_checkpointing`) and into TRL's scoring step
  (`quiet_trl_gradient_checkpointing`; generation, scoring and the IS forward run inside it).
- `warnings.catch_warnings` swaps the process-wide filter list; it is used on the trainer's thread only (no other
  trl_cb or transformers thread enters one), so the list is restored as it was.

tests/unit/test_upstream_warnings.py checks that upstream still warns (so this module can go when TRL moves to the new
names) and that a training run through trl_cb does not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

#: transformers' deprecated aliases TRL calls on the model (`transformers.modeling_utils`).
_MODEL_ALIASES = ("is_gradient_checkpointing", "gradient_checkpointing_disable", "gradient_checkpointing_enable")


def _ignore(name: str, module: str) -> None:
    warnings.filterwarnings(
        "ignore", message=rf"`{name}` is deprecated and will be removed", category=FutureWarning, module=module
    )


@contextlib.contextmanager
def quiet_trl_gradient_checkpointing() -> Iterator[None]:
    """Ignore transformers' FutureWarnings for the `gradient_checkpointing*` model methods TRL calls (also usable as
    a decorator)."""
    with warnings.catch_warnings():
        for name in _MODEL_ALIASES:
            _ignore(name, r"transformers\.modeling_utils")
        yield


@contextlib.contextmanager
def trl_config_post_init(config: Any) -> Iterator[None]:
    """Around a TRL config's `__post_init__`: ignore transformers' FutureWarning for the `gradient_checkpointing`
    argument when `config` holds the field's declared default (TRL's, not the user's choice)."""
    declared = {f.name: f.default for f in dataclasses.fields(config)}.get("gradient_checkpointing")
    with warnings.catch_warnings():
        if getattr(config, "gradient_checkpointing", None) == declared:
            _ignore("gradient_checkpointing", r"transformers\.training_args")
        yield
