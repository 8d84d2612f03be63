"""Async rollouts on the in-process engine (trl_cb/rollouts/async_controller.py): staleness, versions, behaviour
logprobs across updates, lifecycle."""

from __future__ import annotations

import copy
import itertools
import math
import threading
import time

import pytest
import torch

from tests.conftest import sampling_config
from tests.unit.trainers.test_trainers import make_trainer
from trl_cb import ContinuousBatchingGenerator, EngineDiedError, GenerationError, GRPOConfig
from trl_cb.engine import _upstream
from trl_cb.offline.data import synthetic_gsm8k
from trl_cb.rollouts.async_controller import AsyncRolloutController
from trl_cb.rollouts.async_metrics import AsyncMetrics


def controller(model, tokenizer, max_new_tokens=24, cb_config=None, **kwargs) -> AsyncRolloutController:
    rows = synthetic_gsm8k(40, seed=4)
    stream = ((r, tokenizer(r["prompt"])["input_ids"]) for r in itertools.cycle(rows))
    gen = ContinuousBatchingGenerator(
        model, sampling_config(tokenizer, max_new_tokens=max_new_tokens), continuous_batching_config=cb_config
    )
    options = dict(num_generations=2, groups_per_step=2, prefetch_depth=1, max_staleness=1)
    options.update(kwargs)
    ctl = AsyncRolloutController(gen, model, stream, max_prompt_len=64, **options)
    ctl.start()
    return ctl


def run_until_decoding(ctl: AsyncRolloutController) -> None:
    """Let the held engine run until a request in flight has sampled some (not all) of its tokens: an update made now
    lands mid-request (proven, not assumed; no race against a sleep)."""
    while not any(_upstream.inflight_generated_lengths(ctl.backend.manager).values()):
        with ctl.backend.hold.running():
            time.sleep(0.002)


def perturb(model: torch.nn.Module, scale: float = 0.05) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


def logprobs_of(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Teacher-forced logprobs of `tokens` after `prompt` under `model`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def partial_rollout_logprobs(old, new, prompt: list[int], tokens: list[int], b: int) -> torch.Tensor:
    """Logprobs of `tokens[b:]` when the update came after `tokens[:b]` were sampled: the KV of the prompt and of
    `tokens[:b-1]` was computed by `old`; `new` then feeds `tokens[b-1:]` on top of that cache."""
    with torch.no_grad():
        cache = old(torch.tensor([prompt + tokens[: b - 1]]), use_cache=True).past_key_values
        logits = new(torch.tensor([tokens[b - 1 : -1]]), past_key_values=cache, use_cache=True).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[b:])[:, None])[:, 0]


def test_groups_intact_metrics_complete_and_fifo(model, tokenizer):
    ctl = controller(model, tokenizer)
    try:
        order = []
        for _ in range(3):
            groups, metrics = ctl.take(2)
            assert set(metrics.as_dict()) == AsyncMetrics.names()  # every name, every step
            for g in groups:
                assert len(g.completion_ids) == len(g.logprobs) == len(g.versions) == 2
                assert all(len(c) == len(lp) == len(v) for c, lp, v in zip(g.completion_ids, g.logprobs, g.versions))
                order.append(g.row["prompt"])
        rows = [r["prompt"] for r in synthetic_gsm8k(40, seed=4)]
        assert order == rows[: len(order)], "groups must come back in submission order"
    finally:
        ctl.stop()


def test_staleness_bound_enforced_and_drops_counted(model, tokenizer):
    ctl = controller(model, tokenizer, max_staleness=0, prefetch_depth=2)
    try:
        total_dropped = 0
        for _ in range(4):
            groups, metrics = ctl.take(2)
            assert all(ctl.policy_version - g.oldest_version <= 0 for g in groups)
            assert metrics.staleness_max == 0
            total_dropped += metrics.dropped_groups
            assert metrics.dropped_total == total_dropped
            with ctl.weight_update():
                perturb(model, 0.0)
        assert total_dropped > 0, "prefetched groups from older versions must have been dropped"
    finally:
        ctl.stop()


def test_keep_stale_keeps_and_reports(model, tokenizer):
    ctl = controller(model, tokenizer, max_staleness=0, prefetch_depth=2, keep_stale=True)
    try:
        ctl.take(2)
        with ctl.weight_update():
            pass
        _, metrics = ctl.take(2)
        assert metrics.dropped_groups == 0 and metrics.staleness_max >= 1
    finally:
        ctl.stop()


def test_behaviour_logprobs_across_a_weight_update(tokenizer):
    """A completion that straddles an update: tokens sampled before it match the old weights; tokens after it
    match the new weights on top of the KV cache computed with the old ones (partial-rollout semantics). The
    recorded logprobs are what IS must use: they differ from any single-policy recomputation."""
    from trl_cb.offline.tiny import tiny_model

    # No EOS bias: samples run to max_new_tokens, so updates land mid-flight. Std 0.2: far from uniform.
    model = tiny_model(tokenizer, init_std=0.2)
    # At most 4 requests per batch: the groups run in waves, so a take leaves later waves mid-flight (with every
    # request scheduled at once they would all run in lockstep and finish together, before the update).
    ctl = controller(model, tokenizer, max_new_tokens=48, cb_config={"max_requests_per_batch": 4}, prefetch_depth=2)
    try:
        ctl.take(2)  # leaves prefetched groups in flight
        run_until_decoding(ctl)
        old = copy.deepcopy(model)
        with ctl.weight_update():
            perturb(model)
        straddling = []
        for _ in range(2):
            groups, _ = ctl.take(2)
            straddling += [
                (g, i) for g in groups for i, v in enumerate(g.versions) if v[0] == 0 and v[-1] == 1
            ]  # fmt: skip
        assert straddling, "no completion straddled the update"
        for g, i in straddling:
            tokens, recorded, versions = g.completion_ids[i], torch.tensor(g.logprobs[i]), g.versions[i]
            b = versions.index(1)  # first token sampled with the new weights
            before = logprobs_of(old, g.prompt_ids, tokens[:b])
            assert (before - recorded[:b]).abs().max() <= 1e-4
            new_only = logprobs_of(model, g.prompt_ids, tokens)
            assert (new_only[:b] - recorded[:b]).abs().max() >= 0.1, "pre-update tokens must keep old logprobs"
            after = partial_rollout_logprobs(old, model, g.prompt_ids, tokens, b)
            assert (after - recorded[b:]).abs().max() <= 1e-4
            assert (new_only[b:] - recorded[b:]).abs().max() >= 0.1, "post-update tokens saw the old KV prefix"
    finally:
        ctl.stop()


def test_engine_error_surfaces_within_seconds_and_stop_does_not_hang(model, tokenizer):
    ctl = controller(model, tokenizer)
    ctl.take(2)

    def boom(*args, **kwargs):
        raise RuntimeError("simulated engine failure")

    handle = model.model.layers[0].register_forward_pre_hook(boom)
    try:
        start = time.monotonic()
        with pytest.raises((GenerationError, EngineDiedError)):
            for _ in range(5):
                ctl.take(2)
        assert time.monotonic() - start < 10
    finally:
        handle.remove()
        start = time.monotonic()
        ctl.stop()
        ctl.stop()
        assert time.monotonic() - start < 10


def test_async_config_validation():
    def make(**kw):
        return GRPOConfig(output_dir="/tmp/trl_cb_test", report_to=[], use_cpu=True, **kw)

    with pytest.raises(ValueError, match="needs use_transformers_continuous_batching"):
        make(cb_async_generation=True)
    with pytest.raises(ValueError, match="needs cb_importance_sampling_correction=True"):
        make(
            cb_async_generation=True,
            use_transformers_continuous_batching=True,
            cb_importance_sampling_correction=False,
        )
    with pytest.raises(ValueError, match=">= 0"):
        make(cb_async_generation=True, use_transformers_continuous_batching=True, cb_async_max_staleness=-1)


def test_async_rejects_eager_attention(model, tokenizer):
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="sdpa or flash"):
        controller(model, tokenizer)


@pytest.mark.parametrize(
    ("kind", "settings"),
    [
        ("grpo", {}),
        ("rloo", {}),
        ("grpo", dict(init_std=0.2, top_p=0.9, top_k=10, min_p=0.01, repetition_penalty=1.1)),
    ],
    ids=["grpo", "rloo", "grpo-truncated"],
)
def test_trainer_async_is_exact_without_updates_and_logs_every_metric(kind, settings, tokenizer, tmp_path):
    """lr=0: weights never change, so behaviour logprobs must equal TRL's training logprobs even though samples
    were generated across step boundaries (the engine never runs a forward alongside the trainer's) — also under
    truncating and penalising settings, where the IS compares the sampler's temperature-only logprob."""
    trainer = make_trainer(
        kind, tokenizer, tmp_path, cb_async_generation=True, max_steps=3, learning_rate=0.0, max_completion_length=16,
        **settings,
    )  # fmt: skip
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 3
    names = AsyncMetrics.names()
    for entry in logs:
        assert names <= set(entry), names - set(entry)
        assert entry["sampling/sampling_logp_difference/max"] <= 1e-4
    assert max(e["async/staleness_max"] for e in logs) <= 2
    assert logs[-1]["async/policy_version"] == 2
    assert trainer.rollouts.async_rollouts.source is None and trainer.rollouts.generator is None


def test_trainer_async_learns_with_updates(tokenizer, tmp_path):
    trainer = make_trainer(
        "grpo", tokenizer, tmp_path, cb_async_generation=True, max_steps=3, max_completion_length=16
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert all(math.isfinite(e["loss"]) for e in logs)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


# ------------------------------------------------------------------------------- reliability (issue 9, item 1, 3, 6)


def heavy_controller(tokenizer, **kwargs) -> tuple[AsyncRolloutController, torch.nn.Module]:
    """A controller whose in-flight groups take many seconds to generate (the old `stop` generated them all)."""
    from tests.unit.rollouts.test_reliability import far_from_uniform
    from trl_cb.offline.tiny import tiny_model

    model = far_from_uniform(tiny_model(tokenizer, hidden_size=128, num_layers=4), tokenizer)
    options = dict(num_generations=4, groups_per_step=2, prefetch_depth=1, max_staleness=1)
    options.update(kwargs)
    rows = synthetic_gsm8k(40, seed=4)
    stream = ((r, tokenizer(r["prompt"])["input_ids"]) for r in itertools.cycle(rows))
    gen = ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=160))
    ctl = AsyncRolloutController(gen, model, stream, max_prompt_len=64, **options)
    ctl.start()
    return ctl, model


def test_stop_with_rollouts_in_flight_returns_within_2s(tokenizer, monkeypatch):
    from tests.gates import engine_gate
    from tests.unit.rollouts.test_reliability import engine_threads

    ctl, model = heavy_controller(tokenizer, groups_per_step=4)
    ctl.timeout = 0.5
    with engine_gate(model, monkeypatch, after=3) as gate:  # parked mid-generation until `take` holds it again
        with pytest.raises(TimeoutError, match="No rollouts within 0.5 s"):
            ctl.take(4)  # every group is mid-generation, then held
    assert gate.parked
    start = time.monotonic()
    ctl.stop()
    took = time.monotonic() - start
    assert took < 2.0, f"stop() took {took:.2f}s with rollouts in flight"
    assert not engine_threads() and not model.training
    ctl.stop()


def test_ctrl_c_in_take_reaches_the_caller_within_2s(tokenizer, monkeypatch):
    from tests.gates import engine_gate, interrupted_in_round
    from tests.unit.rollouts.test_reliability import engine_threads

    ctl, model = heavy_controller(tokenizer)
    try:
        with engine_gate(model, monkeypatch, after=3) as gate:  # no group can finish before the signal
            latency = interrupted_in_round(lambda: ctl.take(2), gate)
        assert gate.parked and latency is not None and latency < 2.0, latency
        assert ctl.backend.hold.depth == 1, "the engine must be held again after the interrupt"
    finally:
        start = time.monotonic()
        ctl.stop()
        assert time.monotonic() - start < 2.0
    assert not engine_threads()


@pytest.mark.parametrize(
    ("bad", "message"),
    [([], "is empty"), ([5, 6, 100_000], "outside the model's vocabulary"), ([5] * 80, "max_prompt_len=64")],
    ids=["empty", "vocab", "too-long"],
)
def test_prompts_are_validated_before_submission(model, tokenizer, bad, message):
    """Old code submitted them: an empty prompt crashed the engine with an unrelated error, a too-long one failed
    later with 'No requests can be scheduled'."""
    good = tokenizer("what is 2 plus 2?")["input_ids"]
    stream = iter([({"i": i}, good) for i in range(2)] + [({"i": 2}, bad)] + [({"i": i}, good) for i in range(3, 99)])
    gen = ContinuousBatchingGenerator(model, sampling_config(tokenizer))
    ctl = AsyncRolloutController(
        gen, model, stream, max_prompt_len=64, num_generations=2, groups_per_step=2, max_staleness=1
    )
    try:
        with pytest.raises(ValueError, match=rf"Async prompt stream item 2.*{message}|{message}.*item 2"):
            ctl.start()
            for _ in range(3):
                ctl.take(2)
    finally:
        ctl.stop()


def test_async_round_and_sync_round_on_one_model_take_turns(tokenizer):
    """The controller holds the model's round lock while its engine may run: a synchronous generator on the same
    model from another thread waits (old code: both engines ran forwards at once, logprobs off by ~0.4)."""
    from tests.unit.rollouts.test_reliability import far_from_uniform, max_logprob_error
    from trl_cb.offline.tiny import tiny_model

    model = far_from_uniform(tiny_model(tokenizer), tokenizer)
    ctl = controller(model, tokenizer, max_new_tokens=40)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in synthetic_gsm8k(8, seed=9)]
    sync = ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=40))
    sync_results, errors = [], []

    def sync_rounds() -> None:
        try:
            for _ in range(3):
                sync_results.append(sync.generate(prompts, num_generations=2))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    thread = threading.Thread(target=sync_rounds)
    try:
        thread.start()
        groups = [g for _ in range(3) for g in ctl.take(2)[0]]
        thread.join(timeout=120)
        assert not thread.is_alive() and errors == []
        for result in sync_results:
            assert max_logprob_error(model, prompts, result, 2) <= 1e-4
        for g in groups:  # no weight update: behaviour logprobs are the model's own
            for completion, recorded in zip(g.completion_ids, g.logprobs):
                assert (logprobs_of(model, g.prompt_ids, completion) - torch.tensor(recorded)).abs().max() <= 1e-4
    finally:
        ctl.stop()
        sync.close()


# ------------------------------------------------------------------------------ trainer: sizing, resume, defaults


def recording_reward(seen: list[list[str]]):
    def reward(prompts: list[str], completions: list[str], **kwargs: object) -> list[float]:
        seen.append(list(dict.fromkeys(prompts)))  # one entry per step: the step's distinct prompts, in order
        return [len(c) / 50.0 for c in completions]

    return reward


def test_trainer_sizes_the_engine_from_the_longest_prompt_and_validates_every_row(tokenizer, tmp_path):
    """Old code sized the engine from the first 256 rows + 16 tokens and validated nothing: a long prompt further
    down failed inside the engine ('No requests can be scheduled'), an empty one crashed it."""
    from datasets import Dataset

    rows = synthetic_gsm8k(300, seed=5)
    rows[290]["prompt"] = " ".join(["seven plus eight"] * 120)
    long_len = len(tokenizer(rows[290]["prompt"])["input_ids"])
    trainer = make_trainer("grpo", tokenizer, tmp_path, cb_async_generation=True)
    trainer.train_dataset = Dataset.from_list(rows)
    try:
        ctl = trainer.rollouts.async_rollouts.controller()
        assert ctl.generator._pool.engine.workload.max_prompt_len >= long_len
    finally:
        trainer.rollouts.close()
    rows[120]["prompt"] = ""
    trainer.train_dataset = Dataset.from_list(rows)
    trainer.rollouts.async_rollouts.longest_prompt = None
    with pytest.raises(ValueError, match=r"train_dataset rows 0\.\.255: Prompt 120 is empty"):
        trainer.rollouts.async_rollouts.controller()
    trainer.rollouts.close()


def test_trainer_resume_continues_the_prompt_stream(tokenizer, tmp_path):
    """Steps 4-6 after resuming from checkpoint-3 see exactly the prompts an uninterrupted run saw at steps 4-6
    (old code: the stream restarted, steps 4-6 replayed the prompts of steps 1-3)."""
    straight: list[list[str]] = []
    trainer = make_trainer(
        "grpo", tokenizer, tmp_path, cb_async_generation=True, max_steps=6, save_strategy="steps", save_steps=3,
        reward=recording_reward(straight), max_completion_length=8,
    )  # fmt: skip
    trainer.train()
    assert len(straight) == 6 and (tmp_path / "checkpoint-3").is_dir()
    resumed: list[list[str]] = []
    trainer = make_trainer(
        "grpo", tokenizer, tmp_path, cb_async_generation=True, max_steps=6, save_strategy="no",
        reward=recording_reward(resumed), max_completion_length=8,
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert resumed == straight[3:], "resumed run must continue the stream where the checkpoint left it"
    trained_before = {p for step in straight[:3] for p in step}
    assert not trained_before & {p for step in resumed for p in step}, "prompts of steps 1-3 replayed"


def test_default_staleness_drops_nothing_when_taking_every_k_steps(tokenizer, tmp_path):
    """GA=1, steps_per_generation=2, num_iterations=2: a take every k=4 optimizer steps. The old default bound (2)
    dropped the groups the engine had started during the previous take; the default now follows the schedule."""

    def run(**overrides) -> tuple[int, float]:
        trainer = make_trainer(
            "grpo", tokenizer, tmp_path, cb_async_generation=True, max_steps=12, steps_per_generation=2,
            num_iterations=2, max_completion_length=8, **overrides,
        )  # fmt: skip
        trainer.train()
        logs = [e for e in trainer.state.log_history if "async/dropped_total" in e]
        return int(logs[-1]["async/dropped_total"]), max(e["async/staleness_max"] for e in logs)

    dropped, staleness = run()
    assert dropped == 0 and staleness > 2, (dropped, staleness)
    old_dropped, _ = run(cb_async_max_staleness=2)
    assert old_dropped > 0, "control: with the old bound the same schedule drops groups"


def test_stop_with_requests_in_flight_leaves_no_engine_error(tokenizer):
    """`stop` hard-stops with requests in flight: the batch still running must use the engine's attention, i.e. the
    training implementation is restored only after the engine has stopped."""
    from trl_cb.engine import _upstream
    from trl_cb.offline.tiny import tiny_model

    model = tiny_model(tokenizer)
    ctl = controller(model, tokenizer, max_new_tokens=48, cb_config={"max_requests_per_batch": 4}, prefetch_depth=2)
    manager = ctl.backend.manager
    ctl.take(2)  # leaves prefetched groups in flight
    ctl.stop()
    assert _upstream.engine_fatal_error(manager) is None
    assert model.config._attn_implementation == "sdpa"
