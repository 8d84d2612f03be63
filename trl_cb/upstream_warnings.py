"""transformers' `gradient_checkpointing` FutureWarnings that TRL's own calls raise, silenced where trl_cb calls TRL.

Why here, below the configs and the trainers: `configs.py` needs `trl_config_post_init` around TRL's config
`__post_init__` and the trainers need `quiet_trl_gradient_checkpointing` around TRL's calls; neither touches a TRL
internal (that stays in `trainers/trl_internals.py`), only Python's warning filters.

Invariants: only those messages, only `FutureWarning`, only from `transformers.training_args` /
`transformers.modeling_utils`, only inside the `with` block; a user's own use still warns, and the process-wide filter
list is restored as it was (tests/unit/trainers/test_upstream_warnings.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = ["quiet_trl_gradient_checkpointing", "trl_config_post_init"]

# Why: transformers 5.x warns (FutureWarning) on every use of the old gradient-checkpointing names; TRL 1.16 still uses
# them (its configs' `gradient_checkpointing=True` default, `unwrap_model_for_generation` /
# `disable_gradient_checkpointing` several times per step, PEFT's `get_peft_model` in TRL's trainer `__init__`). None
# of it is the user's doing, and a user cannot act on it. `catch_warnings` runs on the caller's thread.

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
