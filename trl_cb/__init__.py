"""trl_cb: continuous-batching rollouts for TRL's GRPO and RLOO trainers.

Change one import — `from trl_cb import GRPOConfig, GRPOTrainer` (or `RLOOConfig, RLOOTrainer`) — and set
`use_transformers_continuous_batching=True`. See docs/index.md.
"""

from .configs import ContinuousBatchingArguments, GRPOConfig, RLOOConfig
from .errors import EngineDiedError, GenerationError
from .rollouts.generator import ContinuousBatchingGenerator, GenerationResult
from .trainers import ContinuousBatchingTrainerMixin, GRPOTrainer, RLOOTrainer
from .version import __version__

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
