"""The `trl-cb` command line: `trl-cb grpo | rloo` (training, `command.py`) and `trl-cb check-model`."""

from ..offline.tiny import tiny_model_path
from .command import (
    ALGORITHMS,
    MODULE,
    SYNTHETIC_GSM8K,
    TINY_MODEL,
    VENDORED_GSM8K,
    Algorithm,
    algorithm,
    load_datasets,
    main,
    make_parser,
    resolve_model,
    resolve_reward,
    reward_registry,
    run_training,
)

__all__ = [
    "ALGORITHMS",
    "MODULE",
    "SYNTHETIC_GSM8K",
    "TINY_MODEL",
    "VENDORED_GSM8K",
    "Algorithm",
    "algorithm",
    "load_datasets",
    "main",
    "make_parser",
    "resolve_model",
    "resolve_reward",
    "reward_registry",
    "run_training",
    "tiny_model_path",
]
