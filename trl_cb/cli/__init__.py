"""The `trl-cb` command line: `trl-cb grpo | rloo` (training, `command.py`) and `trl-cb check-model`.

Nothing here imports torch or transformers at import time: `trl-cb --help` and a refused flag answer in about a
second, the training and check commands import what they run (`trl_cb.offline.tiny.tiny_model_path` builds the tiny
model's files).
"""

from ..offline.names import TINY_MODEL_NO_EOS_BIAS
from .command import (
    ALGORITHMS,
    LAUNCHED_ENV,
    MODULE,
    SYNTHETIC_GSM8K,
    SYNTHETIC_GSM8K_ROWS,
    TINY_MODEL,
    VENDORED_GSM8K,
    VENDORED_GSM8K_TEST_ROWS,
    Algorithm,
    algorithm,
    launch_options,
    load_datasets,
    main,
    make_parser,
    relaunch,
    resolve_model,
    resolve_reward,
    reward_registry,
    run_check_model,
    run_training,
    train,
    under_launcher,
)

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "LAUNCHED_ENV",
    "MODULE",
    "SYNTHETIC_GSM8K",
    "SYNTHETIC_GSM8K_ROWS",
    "TINY_MODEL",
    "TINY_MODEL_NO_EOS_BIAS",
    "VENDORED_GSM8K",
    "VENDORED_GSM8K_TEST_ROWS",
    "algorithm",
    "launch_options",
    "load_datasets",
    "main",
    "make_parser",
    "relaunch",
    "resolve_model",
    "resolve_reward",
    "reward_registry",
    "run_check_model",
    "run_training",
    "train",
    "under_launcher",
]
