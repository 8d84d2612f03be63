"""transformers' `gradient_checkpointing` FutureWarnings that TRL raises are silenced where trl_cb calls TRL, and only
there (trl_cb/upstream_warnings.py)."""

from __future__ import annotations

import warnings

import pytest
import trl
from datasets import Dataset
from trl.models.utils import disable_gradient_checkpointing

from trl_cb import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from trl_cb.offline.data import synthetic_gsm8k
from trl_cb.offline.tiny import tiny_model

PAIRS = {"grpo": (GRPOConfig, GRPOTrainer), "rloo": (RLOOConfig, RLOOTrainer)}


def checkpointing_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, FutureWarning) and "gradient_checkpointing" in str(w.message)
    ]


def length_reward(completions: list[str], **kwargs: object) -> list[float]:
    return [len(c) / 50.0 for c in completions]


def test_upstream_still_warns(tokenizer, tmp_path):
    """Without trl_cb's filter, TRL's config and TRL's generation helper raise the warnings (if this fails, TRL has
    moved to the new names and trl_cb/upstream_warnings.py can go)."""
    model = tiny_model(tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trl.GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True)
        with disable_gradient_checkpointing(model):
            pass
    found = checkpointing_warnings(caught)
    assert any(m.startswith("`gradient_checkpointing` is deprecated") for m in found), found
    assert any(m.startswith("`is_gradient_checkpointing` is deprecated") for m in found), found


RUNS = [("grpo", True, False), ("rloo", True, False), ("grpo", False, False), ("grpo", True, True)]  # kind, CB, LoRA


@pytest.mark.parametrize(("kind", "cb", "lora"), RUNS)
def test_training_run_emits_no_gradient_checkpointing_warning(kind, cb, lora, tokenizer, tmp_path):
    config_cls, trainer_cls = PAIRS[kind]
    extra = {}
    if lora:  # PEFT's get_peft_model, called by TRL's __init__, reads `is_gradient_checkpointing`
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    filters_before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = config_cls(
            output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=8,
            max_steps=2, logging_steps=1, beta=0.0, report_to=[], save_strategy="no", use_cpu=True,
            use_transformers_continuous_batching=cb, disable_tqdm=True,
        )  # fmt: skip
        trainer = trainer_cls(
            model=tiny_model(tokenizer, eos_logit_bias=4.0), reward_funcs=length_reward, args=args,
            train_dataset=Dataset.from_list(synthetic_gsm8k(8, seed=5)), processing_class=tokenizer, **extra,
        )  # fmt: skip
        trainer.train()
    assert trainer.state.global_step == 2
    assert checkpointing_warnings(caught) == []
    assert warnings.filters == filters_before  # nothing left behind in the process-wide filter list


def test_a_user_choice_still_warns(tmp_path):
    """Only TRL's own default is silenced: a user who sets the deprecated argument is still told."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, gradient_checkpointing=False)
    assert any(m.startswith("`gradient_checkpointing` is deprecated") for m in checkpointing_warnings(caught))


def test_model_method_warnings_outside_trl_cb_calls_still_show(tokenizer):
    """The filter is scoped: after a trl_cb call returns, the same upstream call warns again."""
    from trl_cb.upstream_warnings import quiet_trl_gradient_checkpointing

    model = tiny_model(tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_trl_gradient_checkpointing():
            model.is_gradient_checkpointing  # noqa: B018
        assert checkpointing_warnings(caught) == []
        model.is_gradient_checkpointing  # noqa: B018
    assert len(checkpointing_warnings(caught)) == 1
