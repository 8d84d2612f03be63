"""`GRPOTrainer` and `RLOOTrainer`: TRL's trainers with rollouts from trl_cb's continuous batching engine."""

from .mixin import ASYNC_STATE_FILE, IS_METRIC_NAMES, ContinuousBatchingTrainerMixin, GRPOTrainer, RLOOTrainer

__all__ = ["ASYNC_STATE_FILE", "IS_METRIC_NAMES", "ContinuousBatchingTrainerMixin", "GRPOTrainer", "RLOOTrainer"]
