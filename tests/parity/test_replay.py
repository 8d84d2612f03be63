"""Parity by replay: trl_cb with CB on vs TRL's own `generate()` path, fed the same completions (see harness.py).

At lr=0 the two runs must log the same rewards, advantages-derived metrics, loss and gradient norm at every step —
for every GRPO `loss_type`, RLOO, and the TRL features listed below. A CB-path bug that shifts, drops, reorders or
mis-masks a completion, or mis-weights the loss, changes `grad_norm` (a function of every token's advantage-weighted
logprob gradient), so it fails here even where TRL's on-policy loss *value* is ~0.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from tests.parity.conftest import digit_reward, length_reward
from tests.parity.harness import assert_finite, assert_same_logs, prompt_dataset, run_cb, run_trl

# RLOO runs the basic, reward-model, reuse, KL and generation_kwargs cases; the other features go through the same
# shared CB code (trainers.py), so they run on GRPO only, to keep the suite within its time budget.
GRPO_LOSS_TYPES = ["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
#: Replay batches: 2 prompts x 4 samples per step, short completions, some truncated.
ARGS = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=8)


def pair(kind, tmp_path, checkpoint, tokenizer, args=None, model_fn=None, **trainer_kwargs):
    """Run CB, then TRL on the CB run's completions; return both runs."""
    trainer_kwargs.setdefault("reward_funcs", length_reward)
    trainer_kwargs.setdefault("train_dataset", prompt_dataset())
    trainer_kwargs.setdefault("processing_class", tokenizer)
    args = {**ARGS, **(args or {})}
    model_fn = model_fn or (lambda: checkpoint)
    cb = run_cb(kind, tmp_path, model_fn, args, **trainer_kwargs)
    ref = run_trl(kind, tmp_path, model_fn, args, replay=cb, **trainer_kwargs)
    assert cb.completions, "the CB run generated nothing"
    lengths = {len(c) for call in cb.completions for c in call}
    assert len(lengths) > 1, f"completion lengths should vary for a meaningful comparison, got {lengths}"
    return cb, ref


def nonzero_gradient(run) -> None:
    assert any(e.get("grad_norm", 0.0) > 1e-4 for e in run.logs), "a zero gradient would make parity vacuous"


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_grpo_loss_types(loss_type, tmp_path, checkpoint, tokenizer):
    cb, ref = pair("grpo", tmp_path, checkpoint, tokenizer, {"loss_type": loss_type})
    assert_same_logs(cb, ref, required=("loss", "grad_norm", "reward", "sampling/importance_sampling_ratio/mean"))
    nonzero_gradient(cb)
    if loss_type == "vespo":
        assert cb.trainer.args.cb_importance_sampling_mode == "token_mask", "vespo picks a token-level IS mode"


def test_rloo(tmp_path, checkpoint, tokenizer):
    cb, ref = pair("rloo", tmp_path, checkpoint, tokenizer)
    assert_same_logs(cb, ref, required=("loss", "grad_norm", "reward", "sampling/importance_sampling_ratio/mean"))
    nonzero_gradient(cb)


def _reward_model(tokenizer) -> Qwen2ForSequenceClassification:
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return Qwen2ForSequenceClassification(config).eval()


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_multiple_rewards_and_a_reward_model(kind, tmp_path, checkpoint, tokenizer):
    rm = _reward_model(tokenizer)
    cb, ref = pair(
        kind, tmp_path, checkpoint, tokenizer, {"reward_weights": [1.0, 0.5, 2.0]},
        reward_funcs=[length_reward, digit_reward, rm], reward_processing_classes=[None, None, tokenizer],
    )  # fmt: skip
    assert_same_logs(cb, ref, required=("rewards/length_reward/mean", "rewards/digit_reward/mean"))
    means = [k for k in cb.logs[0] if k.startswith("rewards/") and k.endswith("/mean")]
    assert len(means) == 3, f"one reward column per reward source, the reward model's included: {means}"
    nonzero_gradient(cb)


def test_conversational_prompts(tmp_path, checkpoint, chat_tokenizer):
    cb, ref = pair("grpo", tmp_path, checkpoint, chat_tokenizer, train_dataset=prompt_dataset(conversational=True))
    assert_same_logs(cb, ref, required=("loss", "grad_norm"))
    prompt = chat_tokenizer.decode(cb.prompts[0][0])
    assert prompt.startswith("user: ") and prompt.endswith("assistant:"), "the chat template was applied"


@pytest.mark.parametrize(
    ("kind", "args"),
    [
        ("grpo", {"num_iterations": 2, "max_steps": 2}),
        ("grpo", {"steps_per_generation": 2, "max_steps": 2}),
        ("rloo", {"num_iterations": 2, "max_steps": 2}),
    ],
    ids=["grpo-num_iterations", "grpo-steps_per_generation", "rloo-num_iterations"],
)
def test_reuse_of_a_generation_batch(kind, args, tmp_path, checkpoint, tokenizer):
    """Two optimizer steps from one generation: TRL's old logprobs path; the IS weight rides along with it."""
    cb, ref = pair(kind, tmp_path, checkpoint, tokenizer, args)
    assert len(cb.completions) == 1, "both steps must come from one generation round"
    assert_same_logs(cb, ref, required=("loss", "grad_norm"))
    assert len(cb.logs) == 2


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_kl_penalty(kind, tmp_path, checkpoint, tokenizer):
    cb, ref = pair(kind, tmp_path, checkpoint, tokenizer, {"beta": 0.1})
    assert_same_logs(cb, ref, required=("kl", "loss", "grad_norm"))


def test_peft(tmp_path, checkpoint, tokenizer):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    cb, ref = pair("grpo", tmp_path, checkpoint, tokenizer, peft_config=lora)
    assert isinstance(cb.trainer.model, peft.PeftModel)
    assert_same_logs(cb, ref, required=("loss", "grad_norm"))
    nonzero_gradient(cb)


def test_mask_truncated_completions(tmp_path, checkpoint, tokenizer):
    cb, ref = pair("grpo", tmp_path, checkpoint, tokenizer, {"mask_truncated_completions": True})
    assert_same_logs(cb, ref, required=("loss", "grad_norm"))
    truncated = [len(c) == ARGS["max_completion_length"] for call in cb.completions for c in call]
    assert any(truncated) and not all(truncated), "needs both truncated and finished completions"


def test_top_entropy_quantile(tmp_path, checkpoint, tokenizer):
    cb, ref = pair("grpo", tmp_path, checkpoint, tokenizer, {"top_entropy_quantile": 0.5})
    assert_same_logs(cb, ref, required=("loss", "grad_norm", "entropy"))


def test_eval_during_training(tmp_path, checkpoint, tokenizer):
    cb, ref = pair(
        "grpo", tmp_path, checkpoint, tokenizer,
        {"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 8},
        eval_dataset=prompt_dataset(2, seed=11),  # one eval batch: 2 prompts x 4 samples
    )  # fmt: skip
    evals = [e for e in cb.logs if "eval_reward" in e]
    assert evals, "no eval entry logged"
    assert len(cb.completions) == 2, "one train and one eval generation round"
    assert_same_logs(cb, ref)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_generation_kwargs(kind, tmp_path, checkpoint, tokenizer, monkeypatch):
    """TRL's `test_train_with_generation_kwargs` through the CB path, on both trainers, with its kwargs less
    `num_beams=2` (beam search has no per-token sampling policy; trl_cb refuses it at construction, tested in
    tests/unit/checks/test_generation_settings.py) and a smaller top_k:
    it trains, logs TRL's metrics (finite), and the sampler honours the kwargs — top_k=5 truncates the sampled
    distribution, so every processed logprob is >= the trainer-comparable one and some are larger — while the IS
    weight, which compares like with like (docs/index.md), stays 1."""
    from trl_cb import ContinuousBatchingGenerator

    results = []
    real = ContinuousBatchingGenerator.generate

    def spy(self, *args, **kwargs):
        results.append(real(self, *args, **kwargs))
        return results[-1]

    monkeypatch.setattr(ContinuousBatchingGenerator, "generate", spy)
    cb = run_cb(
        kind, tmp_path, lambda: checkpoint,
        {**ARGS, "generation_kwargs": {"do_sample": True, "top_k": 5, "length_penalty": -0.1},
         "cb_importance_sampling_mode": "sequence_truncate",
         "cb_importance_sampling_clip_min": 0.0},
        reward_funcs=length_reward, train_dataset=prompt_dataset(), processing_class=tokenizer,
    )  # fmt: skip
    assert_finite(cb, ("loss", "grad_norm", "reward", "sampling/importance_sampling_ratio/max"))
    assert cb.logs[0]["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-3)
    assert cb.logs[0]["sampling/sampling_logp_difference/max"] <= 1e-4
    processed = torch.tensor([lp for r in results for row in r.logprobs for lp in row])
    policy = torch.tensor([lp for r in results for row in r.policy_logprobs for lp in row])
    assert bool((processed >= policy - 1e-5).all()), "top_k renormalises over the kept tokens"
    assert (processed - policy).max() > 1e-3, "top_k=5 must show in the processed logprobs"
