"""GRPO and RLOO on the CB path: training, IS metrics, the IS weight in the loss, lifecycle."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from datasets import Dataset
from transformers import ProcessorMixin

from trl_cb import ContinuousBatchingGenerator, GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from trl_cb.importance_sampling import IS_EXTRA_METRIC_NAMES
from trl_cb.offline.data import synthetic_gsm8k
from trl_cb.offline.tiny import tiny_model
from trl_cb.rollouts.pool import EnginePool
from trl_cb.trainers import ContinuousBatchingTrainerMixin
from trl_cb.trainers.is_correction import padded_sampling_logps

IS_METRICS = [
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    *IS_EXTRA_METRIC_NAMES,
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
    architecture: str = "qwen2",
    num_layers: int | None = None,
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
    model = tiny_model(
        tokenizer, architecture=architecture, num_layers=num_layers, eos_logit_bias=eos_logit_bias, init_std=init_std
    )
    return trainer_cls(model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_trains_two_steps_logs_is_metrics_one_engine(kind, tokenizer, tmp_path, monkeypatch):
    builds = []
    real_build = EnginePool._build
    monkeypatch.setattr(EnginePool, "_build", lambda self, *a, **k: builds.append(1) or real_build(self, *a, **k))
    trainer = make_trainer(kind, tokenizer, tmp_path)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        for name in IS_METRICS:
            assert name in entry and math.isfinite(entry[name]), name
    assert len(builds) == 1, "one engine across steps"
    assert trainer.rollouts.generator is None, "engine closed at the end of train()"
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


def test_grpo_hands_trl_no_logprob_lists_and_the_batch_carries_the_sampling_logprobs(tokenizer, tmp_path):
    """GRPO gives TRL no per-token logprob lists (it would rebuild a tensor from them token by token): the scored
    batch carries the sampler's rows as TRL's padded `sampling_per_token_logps` (its loss reads them: OPSM here),
    equal to what TRL 1.16 builds from lists (the control: TRL's own construction from the same rows)."""
    from trl.trainer.utils import pad

    trainer = make_trainer("grpo", tokenizer, tmp_path, max_steps=1, off_policy_mask_threshold=0.5)
    returned, scored = [], []
    correction = trainer.rollouts.importance_sampling
    single_turn, correct = trainer._generate_single_turn, correction.correct
    trainer._generate_single_turn = lambda *a, **k: returned.append(single_turn(*a, **k)) or returned[-1]
    correction.correct = lambda output, sampled: scored.append((output, sampled)) or correct(output, sampled)
    trainer.train()
    assert returned and all(ids and logprobs is None for ids, logprobs in returned)
    output, rows = scored[0]
    trl_built = pad(  # GRPOTrainer._generate_and_score_completions (TRL 1.16), from the lists it used to get
        [torch.tensor([float("nan") if x is None else x for x in row]) for row in rows],
        padding_value=0.0,
        padding_side="right",
        pad_to_multiple_of=trainer.pad_to_multiple_of,
    )
    got = output["sampling_per_token_logps"]
    assert got.shape == output["completion_ids"].shape and got.dtype == trl_built.dtype == torch.float32
    assert torch.equal(got[:, : trl_built.size(1)], trl_built) and not got[:, trl_built.size(1) :].any()


def test_logged_logp_difference_shows_a_sampler_that_differs(tokenizer, tmp_path, monkeypatch):
    """Control for the test above: an engine sampling from another policy than the trained one (here at 1.3x the
    temperature, as a dropped soft-cap or window would) shows in the logged difference far above 1e-4."""
    from trl_cb.rollouts import generator as generator_module

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


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_truncating_and_penalising_settings_keep_learning(kind, tokenizer, tmp_path):
    """TRL's own `test_train_with_additional_generation_kwargs` settings (top_p=0.9, top_k=10, min_p=0.01,
    repetition_penalty=1.1, lr=0.1) on weights far from uniform: the IS weight compares the trainer with the sampler's
    own temperature-only logprob, so it is 1 within fp32 noise and every parameter moves. With the processed logprob
    (what trl_cb used to compare) the weight was ~1e-2..1e-11 and the gradient vanished."""
    trainer = make_trainer(
        kind,
        tokenizer,
        tmp_path,
        init_std=0.2,
        learning_rate=0.1,
        max_steps=1,
        top_p=0.9,
        top_k=10,
        min_p=0.01,
        repetition_penalty=1.1,
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    entry = next(e for e in trainer.state.log_history if "loss" in e)
    assert entry["sampling/sampling_logp_difference/max"] <= 1e-4
    assert entry["sampling/importance_sampling_ratio/min"] == pytest.approx(1.0, abs=1e-3)
    assert entry["grad_norm"] > 1e-3
    changed = [not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters())]
    assert all(changed), f"{changed.count(False)} of {len(changed)} parameters did not move"


def _loss(trainer, output) -> float:
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which this test bypasses
    with torch.no_grad():
        return trainer.compute_loss(trainer.model, output).item()


@pytest.mark.parametrize(
    ("kind", "mode"),
    [
        ("grpo", "token_truncate"),
        ("grpo", "sequence_truncate"),
        ("rloo", "sequence_truncate"),
        ("grpo", "token_m2"),
        ("rloo", "geometric_truncate"),
    ],
)
def test_is_weight_reaches_loss_as_the_formula_says(kind, mode, tokenizer, tmp_path):
    """Shift every sampling logprob up by d: log w drops by d per token (token modes, and geometric modes whose
    weight is the mean token ratio in log space) or d * n per sequence (sequence modes). Without an EOS bias every
    completion has n = max_completion_length tokens, so the loss, linear in w, must scale by exactly exp(-d) or
    exp(-d * n). (On-policy, group-normalised advantages make the
    loss value 0; one non-zero advantage makes it the weighted contribution of that sequence alone.)"""
    trainer = make_trainer(
        kind, tokenizer, tmp_path, eos_logit_bias=None, cb_importance_sampling_mode=mode,
        cb_importance_sampling_clip_min=None, cb_importance_sampling_clip_max=1e6, max_completion_length=8,
        cb_importance_sampling_m2_threshold=1e6,
    )  # fmt: skip
    try:
        _check_is_scales_loss(trainer, kind, mode)
    finally:
        trainer.rollouts.close()


def trl_scoring(trainer, batch: list[dict]) -> dict:
    """TRL's own scoring of `batch` (the trainer's CB round included), without trl_cb's IS correction."""
    return super(ContinuousBatchingTrainerMixin, trainer)._generate_and_score_completions(batch)


def _importance_sampling(trainer, output, kind: str, rows) -> None:
    """The eager IS correction of `output` with the sampler's logprobs `rows` (one per completion)."""
    assert trainer.rollouts.importance_sampling.per_token_loss == (kind == "grpo")
    trainer.rollouts.importance_sampling.apply(output, sampling=padded_sampling_logps(output, rows))


def _check_is_scales_loss(trainer, kind: str, mode: str) -> None:
    trainer.model.train()
    batch = [trainer.train_dataset[i] for i in range(2) for _ in range(4)]
    raw = trl_scoring(trainer, batch)
    assert raw["completion_mask"].sum(1).eq(8).all()
    raw["advantages"] = torch.zeros_like(raw["advantages"])
    raw["advantages"][0] = 1.0
    d = 0.01
    base, shifted = copy.deepcopy(raw), copy.deepcopy(raw)
    logprobs = trainer.rollouts.sampling_logprobs
    _importance_sampling(trainer, base, kind, logprobs)
    if "sampling_per_token_logps" in shifted:
        shifted["sampling_per_token_logps"] = shifted["sampling_per_token_logps"] + d * shifted["completion_mask"]
    _importance_sampling(trainer, shifted, kind, [[x + d for x in row] for row in logprobs])
    factor = math.exp(-d * 8) if mode.startswith("sequence") else math.exp(-d)
    loss_base, loss_shifted = _loss(trainer, base), _loss(trainer, shifted)
    assert abs(loss_base) > 1e-6, "advantages must be non-zero for this test to mean anything"
    assert loss_shifted == pytest.approx(factor * loss_base, rel=1e-4)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_self_normalized_is_undoes_a_uniform_shift(kind, tokenizer, tmp_path):
    """With `cb_importance_sampling_normalize`, shifting every sampling logprob by d scales every weight alike, which
    the batch mean divides out: the loss is unchanged (the unnormalised control moves by exp(-d), tested above)."""
    mode = "token_truncate" if kind == "grpo" else "geometric_truncate"
    trainer = make_trainer(
        kind, tokenizer, tmp_path, eos_logit_bias=None, cb_importance_sampling_mode=mode,
        cb_importance_sampling_clip_min=None, cb_importance_sampling_clip_max=1e6, max_completion_length=8,
        cb_importance_sampling_normalize=True,
    )  # fmt: skip
    try:
        trainer.model.train()
        batch = [trainer.train_dataset[i] for i in range(2) for _ in range(4)]
        raw = trl_scoring(trainer, batch)
        raw["advantages"] = torch.zeros_like(raw["advantages"])
        raw["advantages"][0] = 1.0
        base, shifted = copy.deepcopy(raw), copy.deepcopy(raw)
        logprobs = trainer.rollouts.sampling_logprobs
        _importance_sampling(trainer, base, kind, logprobs)
        if "sampling_per_token_logps" in shifted:
            shifted["sampling_per_token_logps"] = (
                shifted["sampling_per_token_logps"] + 0.3 * shifted["completion_mask"]
            )
        _importance_sampling(trainer, shifted, kind, [[x + 0.3 for x in row] for row in logprobs])
        loss_base, loss_shifted = _loss(trainer, base), _loss(trainer, shifted)
        assert abs(loss_base) > 1e-6, "advantages must be non-zero for this test to mean anything"
        assert loss_shifted == pytest.approx(loss_base, rel=1e-4)
    finally:
        trainer.rollouts.close()


def _loss_and_grads(trainer, output) -> tuple[float, list[torch.Tensor]]:
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, output)
    loss.backward()
    return loss.item(), [p.grad.detach().clone() for p in trainer.model.parameters()]


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "eager"])
def test_rloo_token_level_weights_scale_each_tokens_gradient(defer, tokenizer, tmp_path, monkeypatch):
    """RLOO with a token-level IS mode: the loss value is TRL's own (the weights never touch its sequence ratio), and
    the gradient is the truncated-IS policy gradient `-mean_b A_b sum_t w_bt grad log pi_bt`, with
    `w_bt = min(pi/mu, clip_max)` built here by hand from TRL's per-token logprobs and sampler logprobs moved by
    per-token noise (weights 0.6-1.6). Control: TRL's uncorrected gradient is far from it."""
    trainer = make_trainer(
        "rloo", tokenizer, tmp_path, eos_logit_bias=None, cb_importance_sampling_mode="token_truncate",
        cb_importance_sampling_clip_min=None, cb_importance_sampling_clip_max=1.3, max_completion_length=8,
    )  # fmt: skip
    try:
        trainer.model.train()
        batch = [trainer.train_dataset[i] for i in range(2) for _ in range(4)]
        raw = trl_scoring(trainer, batch)
        raw["advantages"] = torch.linspace(-1.0, 1.0, raw["advantages"].numel())
        rows = trainer.rollouts.sampling_logprobs
        noise = [[0.5 * math.sin(7 * b + t) for t in range(len(row))] for b, row in enumerate(rows)]
        rows = [[x + e for x, e in zip(row, n)] for row, n in zip(rows, noise)]
        sampling = padded_sampling_logps(raw, rows)
        corrected = copy.deepcopy(raw)
        monkeypatch.setattr(trainer.rollouts.importance_sampling, "can_defer", lambda output: defer)
        trainer.rollouts.importance_sampling.correct(corrected, rows)
        assert ("cb_deferred_sampling_per_token_logps" in corrected) == defer
        loss, grads = _loss_and_grads(trainer, corrected)

        uncorrected_loss, uncorrected = _loss_and_grads(trainer, copy.deepcopy(raw))
        assert loss == pytest.approx(uncorrected_loss, rel=1e-5, abs=1e-7)

        trainer.model.zero_grad()
        ids = torch.cat([raw["prompt_ids"], raw["completion_ids"]], dim=1)
        attention = torch.cat([raw["prompt_mask"], raw["completion_mask"]], dim=1)
        logps = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attention, raw["completion_ids"].size(1)
        )[0]
        mask = raw["completion_mask"]
        weights = torch.exp(logps.detach() - sampling).clamp(max=1.3) * mask
        assert weights[mask.bool()].min() < 0.7 and (weights == 1.3).any(), "the weights must vary and truncate"
        reference = -(raw["advantages"][:, None] * weights * logps * mask).sum(1).mean()
        reference.backward()
        expected = [p.grad.detach().clone() for p in trainer.model.parameters()]
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
        gap = sum((a - b).norm() for a, b in zip(uncorrected, expected)) / sum(b.norm() for b in expected)
        assert gap > 0.05, f"control: the uncorrected gradient is only {gap:.3f} away"
    finally:
        trainer.rollouts.close()


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
    assert trainer.rollouts.generator is None


def perturb_sampler(patch: pytest.MonkeyPatch) -> None:
    """Shift the sampler's policy logprobs by a fixed pattern (what a sampler with other numerics records): row i's
    tokens by -0.6s, 0.4s, 1.4s, ... with s = 0.02 * (i % 8), so IS weights vary per token and their extremes per
    row (a micro-batch's min/max differs from its generation batch's); deterministic: two runs see the same."""
    real = ContinuousBatchingGenerator.generate

    def generate(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        result.policy_logprobs = [
            [lp + 0.02 * (i % 8) * (t % 3 - 0.6) for t, lp in enumerate(row)]
            for i, row in enumerate(result.policy_logprobs)
        ]
        return result

    patch.setattr(ContinuousBatchingGenerator, "generate", generate)


def _train_recording_forwards(kind, tokenizer, tmp_path, defer: bool, monkeypatch, **overrides):
    """Train 2 steps (a perturbed sampler, so IS weights vary per token) and count the policy forwards run without
    gradients (TRL's and trl_cb's old-logprob forwards) and with them (the loss)."""
    args = dict(
        init_std=0.2, cb_importance_sampling_clip_max=1e6,
        cb_importance_sampling_mode="token_truncate" if kind == "grpo" else "sequence_truncate",
    )  # fmt: skip
    args.update(overrides)
    trainer = make_trainer(kind, tokenizer, tmp_path / str(defer), **args)
    calls = {"no_grad": 0, "grad": 0}
    cls_method = type(trainer)._get_per_token_logps_and_entropies

    def counting(self, *args, **kwargs):
        calls["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        return cls_method(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        perturb_sampler(patch)
        if not defer:
            patch.setattr(trainer.rollouts.importance_sampling, "can_defer", lambda output: False)
        patch.setattr(type(trainer), "_get_per_token_logps_and_entropies", counting)
        trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return logs, [p.detach().clone() for p in trainer.model.parameters()], calls


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_deferred_is_uses_the_loss_forward_and_trains_identically(kind, tokenizer, tmp_path, monkeypatch):
    """When the weights cannot change between scoring and loss (TRL's own condition for reusing the loss forward's
    logprobs as the old policy's), the IS ratio is computed from the loss forward: one no-grad forward fewer per
    step, same IS metrics, same loss, same weights as computing it from an extra forward."""
    deferred_logs, deferred_params, deferred_calls = _train_recording_forwards(
        kind, tokenizer, tmp_path, True, monkeypatch
    )
    eager_logs, eager_params, eager_calls = _train_recording_forwards(kind, tokenizer, tmp_path, False, monkeypatch)
    assert deferred_calls["grad"] == eager_calls["grad"] == 2  # one loss forward per step (one micro-batch)
    assert eager_calls["no_grad"] - deferred_calls["no_grad"] == 2, (eager_calls, deferred_calls)
    # No no-grad forward at all: GRPO's TRL takes the old logprobs from the loss forward under this rule, and trl_cb
    # does the same for RLOO's (`test_rloo_old_logps_come_from_the_loss_forward`), so no batch is run twice.
    assert deferred_calls["no_grad"] == 0, deferred_calls
    for deferred, eager in zip(deferred_logs, eager_logs, strict=True):
        assert eager["sampling/importance_sampling_ratio/min"] < 0.99, "IS weights must vary for this to mean much"
        for name in ("loss", "grad_norm", *IS_METRICS):
            assert deferred[name] == pytest.approx(eager[name], rel=1e-4, abs=1e-6), name
    for a, b in zip(deferred_params, eager_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _teacher_forced_sums(model, inputs, temperature: float) -> torch.Tensor:
    """(B,) sums of the completion tokens' logprobs, `log_softmax(logits / T)`, from one plain forward of `model` on
    prompt + completion: the old-policy sequence logprobs RLOO's loss compares with, computed without TRL."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    width = inputs["completion_ids"].size(1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -width - 1 : -1].float() / temperature
    logps = logits.log_softmax(-1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)  # (B, T)
    return (logps * inputs["completion_mask"]).sum(1)


@pytest.mark.parametrize(
    ("schedule", "loss_forwards"),
    [({}, 2), (dict(num_iterations=2, gradient_accumulation_steps=2, steps_per_generation=1), 4)],
    ids=["default", "iter2-gas2"],  # iter2: the second pass over the buffered batch reads the first pass's old logps
)
def test_rloo_old_logps_come_from_the_loss_forward(schedule, loss_forwards, tokenizer, tmp_path, monkeypatch):
    """TRL's RLOO runs a no-grad forward per batch for the old-policy logprobs. When the weights cannot change before
    the loss (the rule under which GRPO's TRL reuses the loss forward), trl_cb takes them from the loss forward: no
    no-grad forward at all, and every `old_logps` the loss reads equals a teacher-forced forward of the model at that
    moment (sharp weights that move, lr 1e-2). Control: the same oracle on the weights of the first loss (what a
    stale `old_logps` would hold) is far off once the weights moved, so a stale or wrong value would fail."""
    trainer = make_trainer("rloo", tokenizer, tmp_path, init_std=0.2, learning_rate=1e-2, **schedule)
    temperature = trainer.temperature
    reference = tiny_model(tokenizer, eos_logit_bias=4.0)  # a plain module: the oracle runs none of trl_cb's code
    calls, checked, first = {"no_grad": 0, "grad": 0}, [], []
    cls_method = type(trainer)._get_per_token_logps_and_entropies
    compute_loss = trainer._compute_loss

    def counting(self, *args, **kwargs):
        calls["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        return cls_method(self, *args, **kwargs)

    def oracle(weights, inputs) -> torch.Tensor:
        reference.load_state_dict(weights)
        return _teacher_forced_sums(reference.train(trainer.model.training), inputs, temperature)

    def checked_loss(model, inputs):
        loss = compute_loss(model, inputs)  # the loss forward has set `old_logps` by now
        now = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        first.append(first[0] if first else now)  # the weights of the first loss
        old = inputs["old_logps"].detach()
        gaps = ((old - oracle(now, inputs)).abs().max().item(), (old - oracle(first[0], inputs)).abs().max().item())
        checked.append((trainer.state.global_step, *gaps))
        return loss

    with monkeypatch.context() as patch:
        patch.setattr(type(trainer), "_get_per_token_logps_and_entropies", counting)
        patch.setattr(trainer, "_compute_loss", checked_loss)
        trainer.train()
    assert calls == {"no_grad": 0, "grad": loss_forwards}, calls
    assert len(checked) == loss_forwards
    assert max(now for _, now, _ in checked) <= 1e-4, checked
    after_a_step = [old for step, _, old in checked if step >= 1]
    assert after_a_step and min(after_a_step) > 100 * 1e-4, f"control: the weights must move ({checked})"


@pytest.mark.parametrize(
    ("overrides", "skips"),
    [
        ({}, True),
        ({"beta": 0.05}, False),  # TRL's KL penalty reads the per-token values of that forward (set after init:
        # a tiny model from a config has no hub name for TRL's reference model)
        ({"steps_per_generation": 2, "per_device_train_batch_size": 4}, False),  # an update between scoring and loss
        ({"gradient_accumulation_steps": 2, "per_device_train_batch_size": 4}, True),
    ],
)
def test_rloo_old_logps_from_the_loss_only_where_exact(overrides, skips, tokenizer, tmp_path):
    beta = overrides.pop("beta", 0.0)
    trainer = make_trainer("rloo", tokenizer, tmp_path, **overrides)
    trainer.beta = beta
    trainer.model.train()
    assert trainer.rollouts.importance_sampling.old_logps_from_loss() is skips
    trainer.model.eval()
    assert (
        trainer.rollouts.importance_sampling.old_logps_from_loss() is False
    )  # evaluation has no loss forward to take them from


def test_skipped_old_logps_forward_answers_nan_once():
    """The placeholder TRL's scoring gets is NaN (unreplaced, it would make the loss NaN, never silently wrong), and
    a second call in the same scoring is an error: TRL's scoring would have changed."""
    from trl_cb.trainers import trl_internals

    class Trainer:
        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            raise AssertionError("the real forward ran")

    trainer, ids = Trainer(), torch.zeros(3, 7, dtype=torch.long)
    with torch.no_grad(), trl_internals.old_logps_forward_skipped(trainer):
        logps, _, _ = trainer._get_per_token_logps_and_entropies(None, ids, None, 4)
        assert logps.shape == (3, 4) and torch.isnan(logps).all()
        with pytest.raises(RuntimeError, match="unexpected"):
            trainer._get_per_token_logps_and_entropies(None, ids, None, 4)
    assert "_get_per_token_logps_and_entropies" not in trainer.__dict__  # the class's method is back


@pytest.mark.parametrize(
    ("kind", "schedule"),
    [
        ("grpo", dict(gradient_accumulation_steps=2, per_device_train_batch_size=4)),
        ("rloo", dict(gradient_accumulation_steps=2, per_device_train_batch_size=4)),
        ("grpo", dict(gradient_accumulation_steps=2, num_iterations=2, steps_per_generation=1)),
    ],
    ids=["grpo-gas2", "rloo-gas2", "grpo-gas2-iter2"],
)
def test_deferred_is_metrics_reduced_per_generation_batch(kind, schedule, tokenizer, tmp_path, monkeypatch):
    """With several micro-batches per generation batch (GAS=2, or num_iterations=2), the deferred correction logs
    TRL's values: stats over the whole generation batch, logged once (not per micro-batch and averaged). Reference:
    the correction computed at scoring time on the whole batch (TRL's own reduction). Control: logging per micro-batch
    (the old behaviour) gives other min/max values with GAS=2, so the test would see it; with num_iterations=2 and
    steps_per_generation=1 the generation batch is one micro-batch (used twice, corrected once)."""
    deferred_logs, _, calls = _train_recording_forwards(kind, tokenizer, tmp_path, True, monkeypatch, **schedule)
    assert calls["grad"] == 4, calls  # 2 steps x 2 micro-batches, all deferred
    eager_logs, _, _ = _train_recording_forwards(kind, tokenizer, tmp_path / "eager", False, monkeypatch, **schedule)
    for deferred, eager in zip(deferred_logs, eager_logs, strict=True):
        for name in IS_METRICS:
            assert deferred[name] == pytest.approx(eager[name], rel=1e-4, abs=1e-6), name
    if schedule.get("steps_per_generation") == 1:
        return

    from trl_cb.trainers.is_correction import ImportanceSamplingCorrection

    def log_each_micro_batch(self, batch_id, stats):
        self.log_stats(stats, "train")

    monkeypatch.setattr(ImportanceSamplingCorrection, "_add_deferred_stats", log_each_micro_batch)
    per_part_logs, _, _ = _train_recording_forwards(kind, tokenizer, tmp_path / "parts", True, monkeypatch, **schedule)
    moved = [
        name
        for name in ("sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max")
        if any(p[name] != pytest.approx(e[name], rel=1e-4, abs=1e-6) for p, e in zip(per_part_logs, eager_logs))
    ]
    assert moved, "control: per-micro-batch logging should move min/max away from the batch's values"


def test_is_computed_from_an_extra_forward_when_weights_move_before_the_loss(tokenizer, tmp_path):
    """num_iterations=2: the second pass trains on the batch after an update, so the old policy's logprobs must come
    from scoring time; the correction is not deferred."""
    trainer = make_trainer("grpo", tokenizer, tmp_path, num_iterations=2, max_steps=1)
    output = {"old_per_token_logps": None}
    assert not trainer.rollouts.importance_sampling.can_defer(output)
    trainer = make_trainer("grpo", tokenizer, tmp_path, max_steps=1)
    assert trainer.rollouts.importance_sampling.can_defer(output)
    assert not trainer.rollouts.importance_sampling.can_defer({"old_per_token_logps": torch.zeros(1)})
