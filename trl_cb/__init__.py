"""trl_cb: continuous-batching rollouts for TRL's GRPO and RLOO trainers.

Change one import — `from trl_cb import GRPOConfig, GRPOTrainer` (or `RLOOConfig, RLOOTrainer`) — and set
`use_transformers_continuous_batching=True`. See docs/index.md.

The names below are imported on first use (PEP 562, as TRL's and transformers' own top levels do): the trainers pull
in TRL, transformers, datasets and PEFT (about 10 s on a 2-core VM), which `import trl_cb.offline.data`, the `trl-cb`
command's `--help` or a benchmark's flag check must not pay. `from trl_cb import GRPOTrainer` is unchanged.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import EngineDiedError, GenerationError
from .version import __version__

# Public name -> the submodule that defines it (imported when the name is first read).
_LAZY = {
    "ContinuousBatchingArguments": ".configs",
    "GRPOConfig": ".configs",
    "RLOOConfig": ".configs",
    "ContinuousBatchingGenerator": ".rollouts.generator",
    "GenerationResult": ".rollouts.generator",
    "ContinuousBatchingTrainerMixin": ".trainers",
    "GRPOTrainer": ".trainers",
    "RLOOTrainer": ".trainers",
}

if TYPE_CHECKING:  # the static view type checkers and IDEs read
    from .configs import ContinuousBatchingArguments, GRPOConfig, RLOOConfig
    from .rollouts.generator import ContinuousBatchingGenerator, GenerationResult
    from .trainers import ContinuousBatchingTrainerMixin, GRPOTrainer, RLOOTrainer

__all__ = [
    "ContinuousBatchingArguments",
    "ContinuousBatchingGenerator",
    "ContinuousBatchingTrainerMixin",
    "EngineDiedError",
    "GRPOConfig",
    "GRPOTrainer",
    "GenerationError",
    "GenerationResult",
    "RLOOConfig",
    "RLOOTrainer",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # read once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
