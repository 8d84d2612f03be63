"""Async multi-turn training beyond parity (tests/parity/test_tools.py holds the comparisons with TRL's sync loop):
a tool that hangs is answered with an error after `cb_async_tool_timeout` and counted as a failure (the run goes on), a
scripted policy trains with moving weights against a rollout server (turns on the server, tools in the trainer), the
IS correction of a stale run gets every model token's sampling logprob and mask right, and the settings are
validated."""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from tests.parity.scripted import chat_tokenizer, scripted_model
from tests.parity.test_tools import finished_reward, multiply
from tests.unit.rollouts.test_multi_turn import turn_gaps, turns_of
from tests.unit.serving.conftest import KEY, running_server
from trl_cb import GRPOConfig, GRPOTrainer
from trl_cb.offline.agent import agent_tokenizer, calculator, scripted_agent
from trl_cb.trainers.async_bridge import default_max_staleness

RELEASE = threading.Event()


def hanging_multiply(a: int, b: int) -> int:
    """
    Multiplies two integers, eventually.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    RELEASE.wait(600)  # released by the test once it has its answer: nothing here depends on the machine's speed
    return a * b


def trainer(tmp_path: Path, tokenizer, tools: list, **overrides) -> GRPOTrainer:
    args = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=32,
        max_steps=1, logging_steps=1, learning_rate=0.0, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, bf16=False, use_transformers_continuous_batching=True, cb_async_generation=True,
    )  # fmt: skip
    args.update(overrides)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} times 4?"}]} for i in range(4)])
    return GRPOTrainer(
        model=scripted_model(tokenizer), reward_funcs=finished_reward, args=GRPOConfig(**args),
        train_dataset=dataset, processing_class=tokenizer, tools=tools,
    )  # fmt: skip


def test_a_hanging_tool_times_out_as_a_failure(tmp_path):
    """Every sample's call hangs: past `cb_async_tool_timeout` it answers {'error': ...}, counted as a failure as TRL
    counts a raising tool; the samples end as with any failed call and the step completes."""
    RELEASE.clear()
    try:
        run = trainer(tmp_path, chat_tokenizer(), [hanging_multiply], cb_async_tool_timeout=0.5)
        run.train()
    finally:
        RELEASE.set()
    (entry,) = [e for e in run.state.log_history if "loss" in e]
    assert entry["tools/call_frequency"] == 1.0 and entry["tools/failure_frequency"] == 1.0


@pytest.mark.parametrize(("tools", "depth", "expected"), [(True, None, 0), (True, 1, 1), (False, None, 1)])
def test_tools_default_to_prefetch_depth_0_an_explicit_depth_wins(tmp_path, tools, depth, expected):
    """Multi-turn async rollouts default to staleness <= 1 (`DEFAULT_TOOLS_PREFETCH_DEPTH`, measured); a depth the
    user set is kept, and without tools the general default (1) stays. The args show the depth and the staleness
    bound that run (what is logged is what ran; the bound was `None` when unset), also after training; a second
    trainer built from the same config without tools still gets the general default, and its args show that."""
    overrides = {} if depth is None else {"cb_async_prefetch_depth": depth}
    run = trainer(tmp_path, chat_tokenizer(), [multiply] if tools else None, **overrides)
    assert run.rollouts.async_rollouts.prefetch_depth() == expected
    steps_per_take = run.args.steps_per_generation * run.num_iterations / run.args.gradient_accumulation_steps
    assert run.rollouts.async_rollouts.max_staleness() == default_max_staleness(expected, steps_per_take)
    run.train()
    assert run.rollouts.async_rollouts.source is None  # stopped: nothing after this point writes the args
    assert run.args.cb_async_prefetch_depth == expected and run.args.to_dict()["cb_async_prefetch_depth"] == expected
    assert run.args.to_dict()["cb_async_max_staleness"] == default_max_staleness(expected, steps_per_take)  # ran
    again = GRPOTrainer(model=run.model, reward_funcs=finished_reward, args=run.args, train_dataset=run.train_dataset,
                        processing_class=run.processing_class)  # fmt: skip
    assert (
        again.rollouts.async_rollouts.prefetch_depth()
        == again.args.cb_async_prefetch_depth
        == (1 if depth is None else depth)
    )
    again_staleness = default_max_staleness(1 if depth is None else depth, steps_per_take)
    assert again.rollouts.async_rollouts.max_staleness() == again.args.cb_async_max_staleness == again_staleness


@pytest.mark.parametrize(("field", "value"), [("cb_async_tool_workers", 0), ("cb_async_tool_timeout", 0.0)])
def test_tool_settings_are_validated(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        GRPOConfig(output_dir=str(tmp_path), report_to=[], **{field: value})


@pytest.mark.slow
def test_async_tools_train_against_a_rollout_server(tmp_path):
    """Turns generate on a `trl-cb serve` replica (each sample's next turn sent as soon as its tools answered, while
    the trainer trains), tools run in the trainer; weights move (lr > 0) and are pushed every step."""
    tokenizer = chat_tokenizer()
    checkpoint = tmp_path / "scripted"
    scripted_model(tokenizer).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    with running_server(str(checkpoint), "--api-key", KEY) as (_, url):
        run = trainer(
            tmp_path / "out", tokenizer, [multiply], max_steps=3, learning_rate=1e-4, cb_server_urls=[url],
            cb_server_api_key=KEY,
        )  # fmt: skip
        run.train()
    logs = [e for e in run.state.log_history if "loss" in e]
    assert len(logs) == 3 and [e["async/policy_version"] for e in logs] == [1.0, 2.0, 3.0]
    assert all(e["tools/call_frequency"] == 1.0 and e["rewards/finished_reward/mean"] > 1.0 for e in logs)
    assert logs[0]["sampling/sampling_logp_difference/max"] < 1e-4  # fresh weights: the server's logprobs exact


@pytest.mark.slow
def test_every_model_token_is_corrected_with_the_logprob_that_sampled_it(tmp_path):
    """The IS correction of an async tool run with moving weights (staleness >= 1, turns in flight at updates): in the
    scored batch, every model token of every turn carries the logprob the engine sampled it with (= teacher forcing
    over the whole trajectory, tool results in context, under the version recorded for it), counts in the IS mask,
    and every tool token is masked out. float64 weights: the gap is the engine's fp32 logprob (a few ulps), not the
    forward's fp32 noise. Controls: the same tokens without the tool results in context, and under the next
    version's weights, are far off."""
    tokenizer = agent_tokenizer()
    model = scripted_agent(tokenizer, p_again=0.5, margin=8.0).double()
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():  # attention and MLP outputs: the next token depends on the whole context, not the last one
        for layer in model.model.layers:
            for weight in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
                weight.copy_(0.05 * torch.randn(weight.shape, generator=noise, dtype=weight.dtype))
    versions = {0: copy.deepcopy(model)}
    taken, scored = [], []

    class Snapshot(TrainerCallback):
        def on_optimizer_step(self, *a, **k):  # before the engine resumes: the weights of the next version
            snapshot = versions[len(versions)] = copy.deepcopy(versions[0])  # its config: sdpa, not the engine's
            snapshot.load_state_dict(model.state_dict())

    def record(trainer: GRPOTrainer) -> GRPOTrainer:
        """The groups each step takes and the batch its IS correction sees, through the rollout component."""
        async_rollouts, correction = trainer.rollouts.async_rollouts, trainer.rollouts.importance_sampling
        take, correct = async_rollouts.take, correction.correct

        def recording_take(inputs):
            rows = take(inputs)
            taken.append(async_rollouts.step_groups)
            return rows

        def recording_correct(output, sampled):
            keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask")
            scored.append({k: output[k].clone() for k in (*keys, "sampling_per_token_logps")})
            correct(output, sampled)

        async_rollouts.take, correction.correct = recording_take, recording_correct
        return trainer

    rows = [{"prompt": [{"role": "user", "content": f"What is {i} halved?"}]} for i in range(16)]
    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=40,
        max_tool_calling_iterations=3, max_steps=4, logging_steps=1, learning_rate=5e-3, lr_scheduler_type="constant",
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False, beta=0.0,
        use_transformers_continuous_batching=True, cb_async_generation=True, cb_async_prefetch_depth=1,
    )  # fmt: skip
    run = GRPOTrainer(
        model=model, reward_funcs=lambda completions, **k: [float(len(str(c)) % 7) for c in completions], args=args,
        train_dataset=Dataset.from_list(rows), processing_class=tokenizer, tools=[calculator],
        callbacks=[Snapshot()],
    )  # fmt: skip
    record(run).train()

    gaps, no_tools, other_version, updated, later_turns = [], [], [], 0, 0
    for groups, batch in zip(taken, scored, strict=True):
        samples = [(g, k) for g in groups for k in range(len(g.completion_ids))]
        for i, (group, k) in enumerate(samples):
            ids, mask, turn_versions = group.completion_ids[k], group.tool_masks[k], group.versions[k]
            n = len(ids)
            prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
            assert prompt == group.prompt_ids and batch["completion_ids"][i, :n].tolist() == ids
            assert batch["completion_mask"][i, :n].all() and batch["tool_mask"][i, :n].tolist() == mask
            sampled = batch["sampling_per_token_logps"][i, :n]
            assert all(sampled[t] == 0 for t in range(n) if not mask[t]), "tool tokens: logprob 0, masked"
            for n, (start, end) in enumerate(turns_of(mask)):
                updated += len(set(turn_versions[start:end])) > 1  # an update landed inside the turn
                turn = turn_gaps(versions, prompt, ids, mask, turn_versions, sampled[start:end], n, start, end)
                gaps.append(turn.gap)
                if turn.other_version is not None:
                    other_version.append(turn.other_version)
                if n > 0:
                    later_turns += 1
                    no_tools.append(turn.no_tools)
    logs = [e for e in run.state.log_history if "loss" in e]
    staleness = [e["async/staleness_max"] for e in logs]
    print(f"\ntrainer batches vs teacher forcing max|d| = {max(gaps):.2e} over {len(gaps)} turns ({later_turns} "
          f"after a tool, {updated} with an update inside); staleness max per step {staleness}; controls: no tool "
          f"ids {min(no_tools):.3f}, next version {min(other_version):.3f}")  # fmt: skip
    assert len(scored) == 4 and max(staleness) >= 1 and later_turns >= 4
    assert max(gaps) <= 5e-6
    assert min(no_tools) > 1e-2 and min(other_version) > 1e-2
