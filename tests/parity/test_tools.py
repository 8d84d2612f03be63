"""Multi-turn parity: tool calling and environments, CB on vs TRL's `generate()`, with a scripted policy.

Both runs really generate (no scripting of `generate`): the model's weights encode the tool call (scripted.py), so
both paths must produce the same tool calls, the same tool results and the same rewards. On the CB path the sampling
logprobs cover only model-generated tokens: TRL fills tool-result positions with 0.0 and marks them in `tool_mask`,
and the IS correction must ignore them — otherwise a tool token's training logprob (about -6 here) against its
placeholder 0 would show up as a large logprob difference and a wrong IS weight.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from tests.parity.harness import assert_same_logs, run_cb, run_trl
from tests.parity.scripted import CALL, chat_tokenizer, scripted_model
from trl_cb.importance_sampling import importance_sampling_stats

ARGS = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=32)


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def broken_multiply(a: int, b: int) -> int:
    """
    Multiplies two integers, or fails trying.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    raise RuntimeError("tool failure")


class MultiplyEnv:
    """An environment whose tool records the product; `get_reward` scores the rollout from that state."""

    def __init__(self) -> None:
        self.products: list[int] = []

    def reset(self, **kwargs: object) -> None:
        self.products = []

    def multiply(self, a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product of the two integers.
        """
        self.products.append(a * b)
        return a * b

    def get_reward(self) -> float:
        return float(self.products == [12])


def finished_reward(completions: list, **kwargs: object) -> list[float]:
    """1 when the rollout ends with the post-tool answer; plus a term on the number of messages."""
    return [float("Done!" in str(c[-1]["content"])) + 0.1 * len(c) for c in completions]


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


def dataset(n: int = 4) -> Dataset:
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} times 4?"}]} for i in range(n)])


def pair(tmp_path, tokenizer, setup=None, **trainer_kwargs):
    trainer_kwargs.setdefault("reward_funcs", finished_reward)
    trainer_kwargs.setdefault("train_dataset", dataset())
    model_fn = lambda: scripted_model(tokenizer)  # noqa: E731
    cb = run_cb("grpo", tmp_path, model_fn, ARGS, setup=setup, processing_class=tokenizer, **trainer_kwargs)
    ref = run_trl("grpo", tmp_path, model_fn, ARGS, processing_class=tokenizer, **trainer_kwargs)
    return cb, ref


def capture_is_inputs(seen: list[dict]):
    """A `setup` that keeps, for every scored batch, what the CB trainer's IS correction reads."""

    def setup(trainer) -> None:
        correction = trainer.rollouts.importance_sampling
        real = correction.apply

        def capture(output, sampling, old=None):
            # `old` is given when the correction runs inside the loss forward (is_correction.py `compute_loss`)
            seen.append(
                {
                    "tool_mask": output["tool_mask"].clone(),
                    "completion_mask": output["completion_mask"].clone(),
                    "sampling": sampling.clone(),
                    "old": (correction.old_logps(output) if old is None else old).clone(),
                }
            )
            return real(output, sampling=sampling, old=old)

        correction.apply = capture

    return setup


def test_tool_calls_rewards_and_is_mask(tmp_path, tokenizer):
    seen: list[dict] = []
    cb, ref = pair(tmp_path, tokenizer, setup=capture_is_inputs(seen), tools=[multiply])
    assert_same_logs(cb, ref, required=("tools/call_frequency", "tools/failure_frequency", "reward"))
    entry = cb.logs[0]
    assert entry["tools/call_frequency"] == 1.0 and entry["tools/failure_frequency"] == 0.0
    assert entry["rewards/finished_reward/mean"] > 1.0, "every rollout reached the post-tool answer"
    # First round: the scripted call; second round (after the tool result): the answer.
    call_ids = tokenizer.convert_tokens_to_ids(["<tool_call>", CALL, "</tool_call>", "<|end|>"])
    assert cb.completions[0] == [call_ids] * 4
    assert cb.completions[1] == [tokenizer.convert_tokens_to_ids(["Done!", "<|end|>"])] * 4

    # IS ignores tool-result tokens: exact match on model tokens, and the control without tool_mask is far off.
    assert entry["sampling/sampling_logp_difference/max"] < 1e-4
    (batch,) = seen
    tool_mask, completion_mask = batch["tool_mask"], batch["completion_mask"]
    assert (tool_mask == 0).any(), "the completions hold tool-result tokens"
    assert torch.all(batch["sampling"][tool_mask == 0] == 0.0), "tool tokens carry placeholder sampling logprobs"
    ones = torch.ones_like(batch["old"])
    unmasked = importance_sampling_stats(ones, batch["old"], batch["sampling"], completion_mask)
    assert unmasked.diff_max > 1.0, "control: without tool_mask the tool tokens would dominate the IS weight"


def test_tool_failure_is_reported_the_same(tmp_path, tokenizer):
    cb, ref = pair(tmp_path, tokenizer, tools=[broken_multiply])
    assert_same_logs(cb, ref, required=("tools/failure_frequency",))
    assert cb.logs[0]["tools/failure_frequency"] == 1.0


def test_environment_owns_the_reward(tmp_path, tokenizer):
    cb, ref = pair(tmp_path, tokenizer, reward_funcs=None, environment_factory=MultiplyEnv)
    assert_same_logs(cb, ref, required=("rewards/MultiplyEnv/mean", "tools/call_frequency"))
    assert cb.logs[0]["rewards/MultiplyEnv/mean"] == 1.0, "each rollout's environment saw multiply(3, 4)"
    assert cb.logs[0]["sampling/sampling_logp_difference/max"] < 1e-4


# ------------------------------------------------------------------- async: each sample's loop in the producer


ASYNC = {
    "in_process": {"cb_async_generation": True},
    "overlap": {"cb_async_generation": True, "cb_async_overlap": True},
}


def async_pair(tmp_path, tokenizer, mode: str, setup=None, **trainer_kwargs):
    """The CB trainer in async mode (`mode`) against TRL's own sync tool loop, with the scripted policy."""
    trainer_kwargs.setdefault("reward_funcs", finished_reward)
    trainer_kwargs.setdefault("train_dataset", dataset())
    model_fn = lambda: scripted_model(tokenizer)  # noqa: E731
    args = {**ARGS, **ASYNC[mode]}
    cb = run_cb("grpo", tmp_path, model_fn, args, setup=setup, processing_class=tokenizer, **trainer_kwargs)
    ref = run_trl("grpo", tmp_path, model_fn, ARGS, processing_class=tokenizer, **trainer_kwargs)
    return cb, ref


@pytest.mark.parametrize("mode", sorted(ASYNC))
def test_async_tool_calls_match_the_sync_loop(tmp_path, tokenizer, mode):
    """The producer ran each sample's tool loop (the trainer's scoring sees only the first turn, then the replayed
    loop): same calls, rewards and metrics as TRL's sync loop; the tool tokens carry placeholder logprobs and are
    masked from IS (the control without the mask is far off)."""
    seen: list[dict] = []
    cb, ref = async_pair(tmp_path, tokenizer, mode, setup=capture_is_inputs(seen), tools=[multiply])
    assert_same_logs(cb, ref, required=("tools/call_frequency", "tools/failure_frequency", "reward"))
    entry = cb.logs[0]
    assert entry["tools/call_frequency"] == 1.0 and entry["rewards/finished_reward/mean"] > 1.0
    call_ids = tokenizer.convert_tokens_to_ids(["<tool_call>", CALL, "</tool_call>", "<|end|>"])
    assert cb.completions == [[call_ids] * 4], "TRL's first generation call gets the first turns, nothing more"
    assert entry["sampling/sampling_logp_difference/max"] < 1e-4
    (batch,) = seen
    tool_mask = batch["tool_mask"]
    assert (tool_mask == 0).any() and torch.all(batch["sampling"][tool_mask == 0] == 0.0)
    ones = torch.ones_like(batch["old"])
    assert importance_sampling_stats(ones, batch["old"], batch["sampling"], batch["completion_mask"]).diff_max > 1.0


def test_async_tool_failure_and_environment_match_the_sync_loop(tmp_path, tokenizer):
    """A failing tool answers with its error and counts as a failure (TRL's semantics), never ends the run; an
    environment's instance (reset at rollout time, replayed at scoring) scores its own rollout."""
    cb, ref = async_pair(tmp_path / "fail", tokenizer, "in_process", tools=[broken_multiply])
    assert_same_logs(cb, ref, required=("tools/failure_frequency",))
    assert cb.logs[0]["tools/failure_frequency"] == 1.0
    cb, ref = async_pair(tmp_path / "env", tokenizer, "in_process", reward_funcs=None, environment_factory=MultiplyEnv)
    assert_same_logs(cb, ref, required=("rewards/MultiplyEnv/mean", "tools/call_frequency"))
    assert cb.logs[0]["rewards/MultiplyEnv/mean"] == 1.0
