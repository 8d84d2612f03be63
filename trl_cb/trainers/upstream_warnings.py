"""Silence transformers' `gradient_checkpointing` deprecation warnings that TRL's own code raises, where trl_cb calls
TRL — and nowhere else.

Why: transformers 5.x warns (FutureWarning) on every use of the old gradient-checkpointing names; TRL 1.16 still uses
them (its configs' `gradient_checkpointing=True` default, `unwrap_model_for_generation` /
`disable_gradient_checkpointing` several times per step, PEFT's `get_peft_model` in TRL's trainer `__init__`). None
of it is the user's doing, and a user cannot act on it.

Guarantees: only those four messages, only `FutureWarning`, only from `transformers.training_args` /
`transformers.modeling_utils`, only inside the `with` block (a user's own use elsewhere, or a `gradient_checkpointing`
value the user changed, still warns). Call sites: the configs' TRL `__post_init__`, the trainers' TRL `__init__` and
scoring step. `warnings.catch_warnings` runs on the trainer's thread only, so the filter list is restored as it was.
tests/unit/trainers/test_upstream_warnings.py checks that upstream still warns and a run through trl_cb does not.
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
