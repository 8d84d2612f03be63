"""Hybrid models (Qwen3.5 layout: Gated DeltaNet + attention) through trl_cb's rollout paths: an async weight update
mid-request (the state written by the old weights is kept, as its KV is; checked against tests/hybrid_reference.py),
GRPO async and overlapped with training, and TRL's GRPO / RLOO on the class TRL's own tests use.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.hybrid_reference import StepTrace, replay_logprobs
from tests.model_zoo import HYBRID, tiny_arch_model
from tests.unit.rollouts.test_async import controller, perturb, run_until_decoding
from tests.unit.trainers.test_trainers import make_trainer
from trl_cb.offline.data import synthetic_gsm8k

QWEN3_5 = next(a for a in HYBRID if a.model_type == "qwen3_5_text")
#: The fp32 trainer against the fp32 engine: Gated DeltaNet's chunked (training) and recurrent (decode) kernels differ
#: by up to ~2e-4 nats on these sharp tiny weights, transformers' own generate() as much (tests/unit/engine/
#: test_hybrid_engine.py); a structural error moves logprobs by > 0.1.
FP32_HYBRID_TOL = 1e-3


def test_async_weight_update_mid_request_keeps_the_state_the_old_weights_wrote(tokenizer, monkeypatch):
    """Async rollouts, weights updated while requests are mid-generation (float64): every token equals the cached
    computation with the old weights up to the update and the new weights after it, on the recurrent state (and KV)
    the old weights wrote. Control: the new weights recomputing the prefix miss by > 1e-3."""
    model = tiny_arch_model(QWEN3_5, len(tokenizer), dtype=torch.float64)  # no EOS bias: completions run to the end
    trace = StepTrace().install(monkeypatch)
    ctl = controller(model, tokenizer, max_new_tokens=24, cb_config={"max_requests_per_batch": 4}, prefetch_depth=2)
    try:
        ctl.take(2)  # leaves prefetched groups in flight
        run_until_decoding(ctl)
        old = copy.deepcopy(model)
        with ctl.weight_update():
            perturb(model)
            trace.version = 1  # every step from here runs the new weights
        straddling = []
        for _ in range(2):
            groups, _ = ctl.take(2)
            straddling += [(g, i) for g in groups for i, v in enumerate(g.versions) if v[0] == 0 and v[-1] == 1]
    finally:
        ctl.stop()
    assert straddling, "no completion straddled the update"
    gaps, new_prefix = [], []
    for g, i in straddling:
        rid = trace.group_request_ids(g.prompt_ids, g.completion_ids)[i]
        sequence, recorded = g.prompt_ids + g.completion_ids[i], torch.tensor(g.logprobs[i], dtype=torch.float64)
        segments = trace.of(rid)
        assert {s.version for s in segments} == {0, 1}
        switch = g.versions[i].index(1)  # the first token sampled by the new weights
        reference = replay_logprobs({0: old, 1: model}, segments, sequence, len(g.prompt_ids), 1.0)
        gaps.append((reference - recorded).abs().max().item())
        recomputed = replay_logprobs({0: model, 1: model}, segments, sequence, len(g.prompt_ids), 1.0)
        new_prefix.append((recomputed[switch:] - recorded[switch:]).abs().max().item())
    print(f"\n[hybrid] async update mid-request: {len(gaps)} straddling, max {max(gaps):.1e}, "
          f"new weights over a recomputed prefix {min(new_prefix):.1e}")  # fmt: skip
    assert max(gaps) <= 1e-5 and min(new_prefix) > 1e-3


ASYNC = {"cb_async_generation": True}


@pytest.mark.parametrize("settings", [ASYNC, {**ASYNC, "cb_async_overlap": True}], ids=["async", "overlap"])
def test_async_trainers_on_a_hybrid_model_sample_what_they_train(settings, tokenizer, tmp_path):
    """GRPO through trl_cb on Qwen3.5's layout (std 0.2), async and overlapped with training (sync GRPO / RLOO: the
    test below): lr=0, so every logged sampling/training gap is the fp32 kernel gap only."""
    trainer = make_trainer(
        "grpo", tokenizer, tmp_path, init_std=0.2, architecture="qwen3_5", max_steps=2,
        learning_rate=0.0, max_completion_length=16, **settings,
    )  # fmt: skip
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 2
    worst = max(e["sampling/sampling_logp_difference/max"] for e in logs)
    print(f"\n[hybrid] grpo {settings}: sampling_logp_difference/max {worst:.1e}")
    assert worst <= FP32_HYBRID_TOL


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_trl_tiny_qwen3_5_vlm_class_trains_through_trl_cb(kind, tokenizer, tmp_path):
    """TRL's own GRPO / RLOO tests use `tiny-Qwen3_5ForConditionalGeneration` (hub, with images: not offline, and the
    engine serves text); the same class built from a config, text-only, trains through trl_cb as those tests check:
    a loss is logged and the language model's parameters move, with the sampling gap at fp32 noise."""
    from datasets import Dataset
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    from tests.model_zoo import tiny_config
    from tests.unit.trainers.test_trainers import PAIRS

    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    text = tiny_config(QWEN3_5, len(tokenizer), special).to_dict()  # the zoo's Qwen3.5 shape, std 0.2
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision))
    config_cls, trainer_cls = PAIRS[kind]
    args = config_cls(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=12,
        max_steps=2, logging_steps=1, learning_rate=0.1, beta=0.0, bf16=False, report_to=[], save_strategy="no",
        use_cpu=True, use_transformers_continuous_batching=True, disable_tqdm=True, top_k=0, top_p=1.0,
    )  # fmt: skip
    trainer = trainer_cls(model=model, reward_funcs=lambda completions, **_: [len(c) / 50 for c in completions],
                          args=args, train_dataset=Dataset.from_list(synthetic_gsm8k(8, seed=5)),
                          processing_class=tokenizer)  # fmt: skip
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "visual" not in n}
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert trainer.state.log_history[-1]["train_loss"] is not None and len(logs) == 2
    first = logs[0]["sampling/sampling_logp_difference/max"]  # sampled before the first update
    print(f"\n[hybrid] {kind} on Qwen3_5ForConditionalGeneration: sampling_logp_difference/max {first:.1e}")
    assert first <= FP32_HYBRID_TOL
    moved = [n for n, p in before.items() if not torch.equal(p, trainer.model.get_parameter(n))]
    assert len(moved) > len(before) // 2, f"only {len(moved)} of {len(before)} language-model parameters moved"
