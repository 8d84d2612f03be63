"""Async multi-turn training beyond parity (tests/parity/test_tools.py holds the comparisons with TRL's sync loop):
a tool that hangs is answered with an error after `cb_async_tool_timeout` and counted as a failure (the run goes on), a
scripted policy trains with moving weights against a rollout server (turns on the server, tools in the trainer), and
the settings are validated."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from datasets import Dataset

from tests.parity.scripted import chat_tokenizer, scripted_model
from tests.parity.test_tools import finished_reward, multiply
from tests.unit.serving.conftest import KEY, running_server
from trl_cb import GRPOConfig, GRPOTrainer

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
