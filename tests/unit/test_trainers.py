"""GRPO and RLOO on the CB path: training, IS metrics, the IS weight in the loss, lifecycle."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from datasets import Dataset
from transformers import ProcessorMixin

from trl_cb import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from trl_cb.data import synthetic_gsm8k
from trl_cb.generator import ContinuousBatchingGenerator
from trl_cb.tiny import tiny_model

IS_METRICS = [
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
]
PAIRS = {"grpo": (GRPOConfig, GRPOTrainer), "rloo": (RLOOConfig, RLOOTrainer)}


def length_reward(completions: list[str], **kwargs: object) -> list[float]:
    """Varies across samples, so advantages are non-zero and the loss depends on them."""
    return [len(c) / 50.0 for c in completions]


def make_trainer(
    kind: str,
    tokenizer,
    tmp_path,
    eos_logit_bias: float | None = 4.0,
    reward=length_reward,
    init_std: float | None = None,
    **overrides,
):
    config_cls, trainer_cls = PAIRS[kind]
    kwargs = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=24,
        max_steps=2,
        logging_steps=1,
        learning_rate=1e-3,
        beta=0.0,
        bf16=False,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        use_transformers_continuous_batching=True,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    args = config_cls(**kwargs)
    dataset = Dataset.from_list(synthetic_gsm8k(16, seed=5))
    model = tiny_model(tokenizer, eos_logit_bias=eos_logit_bias, init_std=init_std)
    return trainer_cls(model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_trains_two_steps_logs_is_metrics_one_engine(kind, tokenizer, tmp_path, monkeypatch):
    builds = []
    real_build = ContinuousBatchingGenerator._build_engine
    monkeypatch.setattr(
        ContinuousBatchingGenerator,
        "_build_engine",
        lambda self, *a, **k: builds.append(1) or real_build(self, *a, **k),
    )
    trainer = make_trainer(kind, tokenizer, tmp_path)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        for name in IS_METRICS:
            assert name in entry and math.isfinite(entry[name]), name
    assert len(builds) == 1, "one engine across steps"
    assert trainer._cb_generator is None, "engine closed at the end of train()"
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters())), "weights never updated"


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_sampling_logprobs_match_trl_training_logprobs(kind, tokenizer, tmp_path):
    """With top_k=0/top_p=1 the CB logprobs equal TRL's temperature-scaled training logprobs (fp32; weights of
    std 0.2, so distributions are far from uniform — the control below shows a wrong sampler would show)."""
    trainer = make_trainer(kind, tokenizer, tmp_path, init_std=0.2, temperature=0.7, top_k=0, top_p=1.0)
    trainer.train()
    for entry in (e for e in trainer.state.log_history if "loss" in e):
        assert entry["sampling/sampling_logp_difference/max"] <= 1e-4
        assert entry["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-3)


def test_logged_logp_difference_shows_a_sampler_that_differs(tokenizer, tmp_path, monkeypatch):
    """Control for the test above: an engine sampling from another policy than the trained one (here at 1.3x the
    temperature, as a dropped soft-cap or window would) shows in the logged difference far above 1e-4."""
    from trl_cb import generator as generator_module

    real = generator_module.engine_generation_config

    def skewed(cfg):
        out = real(cfg)
        out.temperature = cfg.temperature * 1.3
        return out

    monkeypatch.setattr(generator_module, "engine_generation_config", skewed)
    trainer = make_trainer("grpo", tokenizer, tmp_path, init_std=0.2, temperature=0.7, top_k=0, top_p=1.0, max_steps=1)
    trainer.train()
    entry = next(e for e in trainer.state.log_history if "loss" in e)
    assert entry["sampling/sampling_logp_difference/max"] >= 0.1


def test_truncated_sampling_is_ratio_at_most_one(tokenizer, tmp_path):
    """With top_p < 1, the sampler renormalises over the kept tokens, TRL's training logprobs do not: the sampling
    logprob is >= the training one per token, so every token-level IS weight is <= 1 (docs/index.md)."""
    trainer = make_trainer(
        "grpo", tokenizer, tmp_path, top_p=0.8, cb_importance_sampling_mode="token_truncate", max_steps=1
    )
    trainer.train()
    entry = next(e for e in trainer.state.log_history if "loss" in e)
    assert entry["sampling/importance_sampling_ratio/max"] <= 1.0 + 1e-5
    assert entry["sampling/importance_sampling_ratio/min"] < 0.99, "truncation should show in the weights"


def _loss(trainer, output) -> float:
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which this test bypasses
    with torch.no_grad():
        return trainer.compute_loss(trainer.model, output).item()


@pytest.mark.parametrize(
    ("kind", "mode"), [("grpo", "token_truncate"), ("grpo", "sequence_truncate"), ("rloo", "sequence_truncate")]
)
def test_is_weight_reaches_loss_as_the_formula_says(kind, mode, tokenizer, tmp_path):
    """Shift every sampling logprob up by d: log w drops by d per token (token modes) or d * n per sequence
    (sequence modes). Without an EOS bias every completion has n = max_completion_length tokens, so the loss,
    linear in w, must scale by exactly exp(-d) or exp(-d * n). (On-policy, group-normalised advantages make the
    loss value 0; one non-zero advantage makes it the weighted contribution of that sequence alone.)"""
    trainer = make_trainer(
        kind, tokenizer, tmp_path, eos_logit_bias=None, cb_importance_sampling_mode=mode,
        cb_importance_sampling_clip_min=None, cb_importance_sampling_clip_max=1e6, max_completion_length=8,
    )  # fmt: skip
    try:
        _check_is_scales_loss(trainer, kind, mode)
    finally:
        trainer._cb_close()


def _check_is_scales_loss(trainer, kind: str, mode: str) -> None:
    trainer.model.train()
    batch = [trainer.train_dataset[i] for i in range(2) for _ in range(4)]
    raw = super(type(trainer), trainer)._generate_and_score_completions(batch)  # TRL's, without our IS
    assert raw["completion_mask"].sum(1).eq(8).all()
    raw["advantages"] = torch.zeros_like(raw["advantages"])
    raw["advantages"][0] = 1.0
    d = 0.01
    base, shifted = copy.deepcopy(raw), copy.deepcopy(raw)
    logprobs = trainer._cb_last_logprobs
    trainer._cb_importance_sampling(base, per_token_loss=kind == "grpo")
    if "sampling_per_token_logps" in shifted:
        shifted["sampling_per_token_logps"] = shifted["sampling_per_token_logps"] + d * shifted["completion_mask"]
    trainer._cb_last_logprobs = [[x + d for x in row] for row in logprobs]
    trainer._cb_importance_sampling(shifted, per_token_loss=kind == "grpo")
    factor = math.exp(-d) if mode.startswith("token") else math.exp(-d * 8)
    loss_base, loss_shifted = _loss(trainer, base), _loss(trainer, shifted)
    assert abs(loss_base) > 1e-6, "advantages must be non-zero for this test to mean anything"
    assert loss_shifted == pytest.approx(factor * loss_base, rel=1e-4)


def test_is_disabled_leaves_loss_untouched(tokenizer, tmp_path):
    trainer = make_trainer("grpo", tokenizer, tmp_path, cb_importance_sampling_correction=False, max_steps=1)
    trainer.train()
    entry = next(e for e in trainer.state.log_history if "loss" in e)
    assert not any(name in entry for name in IS_METRICS)


class _FakeProcessor(ProcessorMixin):
    def __init__(self) -> None:  # a multimodal processor stand-in: only its type matters
        pass


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_multimodal_processor_rejected(kind, tokenizer, tmp_path):
    config_cls, trainer_cls = PAIRS[kind]
    args = config_cls(output_dir=str(tmp_path), report_to=[], use_cpu=True, use_transformers_continuous_batching=True)
    with pytest.raises(ValueError, match="does not support multimodal"):
        trainer_cls(
            model=tiny_model(tokenizer), reward_funcs=length_reward, args=args, processing_class=_FakeProcessor()
        )


def test_engine_closed_when_training_fails(tokenizer, tmp_path):
    def failing_reward(completions, **kwargs):
        raise KeyboardInterrupt  # what Ctrl-C looks like from inside a step

    trainer = make_trainer("grpo", tokenizer, tmp_path, reward=failing_reward)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer._cb_generator is None
