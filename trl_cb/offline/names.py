"""The offline models' names, the same wherever a model name is accepted (the CLI, the example scripts, their
defaults): they build a tiny random model locally instead of downloading anything."""

from __future__ import annotations

__all__ = ["TINY_MODEL", "TINY_MODEL_NO_EOS_BIAS", "TINY_MODELS", "is_tiny_model_name"]

TINY_MODEL = "trl-cb/tiny"
#: The same model without the EOS bias: completions run to `max_completion_length`; the offline recipes train it on
#: `char_share_reward`, which it learns (the biased one learns to stop at once instead).
TINY_MODEL_NO_EOS_BIAS = "trl-cb/tiny-no-eos-bias"
#: Offline model name -> (checkpoint directory under the temp directory, EOS logit bias; see `offline/tiny.py`).
#: `tiny` is the spelling the example scripts used before (`--model_name_or_path tiny`).
TINY_MODELS = {
    TINY_MODEL: ("trl_cb_tiny_qwen2", 4.0),
    "tiny": ("trl_cb_tiny_qwen2", 4.0),
    TINY_MODEL_NO_EOS_BIAS: ("trl_cb_tiny_qwen2_no_eos_bias", None),
}


def is_tiny_model_name(name: str | None) -> bool:
    """Whether `name` asks for an offline tiny model."""
    return name in TINY_MODELS
