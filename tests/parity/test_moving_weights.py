"""Parity with moving weights: lr > 0 over several steps, weights far from uniform, truncating sampling settings and
bf16 — trl_cb with CB on vs TRL's own `generate()` path on the same completions (see harness.py).

At lr = 0 (test_replay.py) the IS weight is 1 by construction and a stale-weight, old-logprob or truncated-sampling
error cannot show. Here the weights change every step, so each CB round must sample from the updated model and its
IS weight must stay 1 within fp32 noise for the two runs to make the same updates: every logged metric and the final
weights agree. With bf16 the sampler runs on bf16 copies while TRL trains under autocast: the IS weight then carries
bf16 noise and the updates must still point the same way.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from tests.parity.conftest import length_reward
from tests.parity.harness import assert_same_logs, prompt_dataset, run_cb, run_trl
from trl_cb.offline.tiny import tiny_model

#: 2 prompts x 4 samples per step, 3 optimizer steps that each move every weight.
ARGS = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=3, learning_rate=1e-2)
#: TRL's own `test_train_with_additional_generation_kwargs` settings.
TRUNCATED = dict(top_p=0.9, top_k=10, min_p=0.01, repetition_penalty=1.1)


@pytest.fixture(scope="module")
def sharp_checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerFast) -> str:
    """The parity tokenizer with a std-0.2 model (next-token distributions far from uniform) whose completions end
    at varied lengths."""
    path = Path(tmp_path_factory.mktemp("sharp_ckpt"))
    tiny_model(tokenizer, eos_logit_bias=6.0, init_std=0.2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _pair(kind: str, tmp_path: Path, checkpoint: str, tokenizer: PreTrainedTokenizerFast, args: dict):
    kwargs = dict(reward_funcs=length_reward, train_dataset=prompt_dataset(), processing_class=tokenizer)
    cb = run_cb(kind, tmp_path, lambda: checkpoint, {**ARGS, **args}, **kwargs)
    ref = run_trl(kind, tmp_path, lambda: checkpoint, {**ARGS, **args}, replay=cb, **kwargs)
    lengths = {len(c) for call in cb.completions for c in call}
    assert len(lengths) > 1, f"completion lengths should vary for a meaningful comparison, got {lengths}"
    return cb, ref


def _updates(cb, ref, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Each run's total weight change over training, flattened."""
    start = [p.float() for p in tiny_model(tokenizer, eos_logit_bias=6.0, init_std=0.2).parameters()]

    def update(run) -> torch.Tensor:
        params = run.trainer.model.parameters()
        return torch.cat([(p.detach().float() - s).flatten() for p, s in zip(params, start, strict=True)])

    return update(cb), update(ref)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
@pytest.mark.parametrize("settings", [{}, TRUNCATED], ids=["full", "truncated"])
def test_updates_match_trl_with_moving_weights(kind, settings, tmp_path, sharp_checkpoint, tokenizer):
    cb, ref = _pair(kind, tmp_path, sharp_checkpoint, tokenizer, settings)
    assert_same_logs(cb, ref, required=("loss", "grad_norm", "reward", "sampling/importance_sampling_ratio/min"))
    for entry in cb.logs:
        assert entry["grad_norm"] > 1e-3, "a vanishing gradient would make parity vacuous"
        assert entry["sampling/sampling_logp_difference/max"] <= 1e-4, entry
    cb_update, ref_update = _updates(cb, ref, tokenizer)
    assert (ref_update != 0).float().mean() > 0.5, "most weights move (embedding rows of unseen tokens do not)"
    # Element-wise, Adam turns fp32 noise in near-zero gradients into visible steps; the update as a whole agrees.
    relative = ((cb_update - ref_update).norm() / ref_update.norm()).item()
    assert relative <= 1e-3, f"||update_cb - update_trl|| / ||update_trl|| = {relative:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_bf16_updates_follow_trl(kind, tmp_path, sharp_checkpoint, tokenizer):
    """bf16=True (TRL's default): the sampler runs on bf16 copies, TRL trains under autocast on fp32 weights. Same
    completions, same rewards; the IS weight is 1 up to bf16 noise, so the updates point the same way as TRL's."""
    cb, ref = _pair(kind, tmp_path, sharp_checkpoint, tokenizer, dict(bf16=True))
    for a, b in zip(cb.logs, ref.logs, strict=True):
        assert a["reward"] == pytest.approx(b["reward"], rel=1e-6)
        assert a["sampling/sampling_logp_difference/mean"] <= 0.1, a
        assert math.isfinite(a["loss"]) and math.isfinite(a["grad_norm"])
    cb_update, ref_update = _updates(cb, ref, tokenizer)
    cosine = torch.nn.functional.cosine_similarity(cb_update, ref_update, dim=0).item()
    assert cosine >= 0.9, f"trl_cb's bf16 update direction differs from TRL's: cosine {cosine:.3f}"
    assert all(p.dtype == torch.float32 for p in cb.trainer.model.parameters()), "fp32 master weights stay fp32"
