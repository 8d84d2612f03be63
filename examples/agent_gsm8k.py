"""GRPO on GSM8K with a calculator tool, multi-turn and async: each sample's tool loop runs in the rollout producer
while other samples generate and the trainer trains (docs/async.md, "Multi-turn: tools and environments").

Offline (CPU, ~20 s on 2 cores): a scripted tool-calling tiny policy (`trl_cb.offline.agent`: it calls the
calculator, then after each tool answer calls it again with probability --p_again, 0.7, or answers), the GSM8K test
split shipped with trl_cb:
    python examples/agent_gsm8k.py --output_dir /tmp/agent

The scripted answer is always "#### 24", so GSM8K accuracy cannot be learned offline; the offline reward (`--reward
one_call`) is 1 for a rollout that answers right after its first tool answer, and learning means the policy stops
calling the tool again (the task of `benchmarks/learning.py --task agent`). The default run (8 steps of 2 prompts x 4
samples, lr 3e-3) shows it. Measured 2026-11-28 on a 2-core CPU shared with other jobs, seeds 0-4 (`--seed`), 9 runs:
`reward` at step 1 -> step 8 from 0.125-0.5 to 1.0 in every run (1.0 from step 4-6 on; seeds 0, 1, 2: 0.25 -> 1.0, 0.25
-> 1.0, 0.125 -> 1.0), `tools/call_frequency` from 2-3.1 to 1.0; whole command 16-25 s. Seeds fix the data and the
initial weights, not the batch rewards: async rollouts sample in an order set by thread timing, so two runs of one seed
differ step by step. `--max_steps 4` (one run): 0.125 -> 0.625.

A real model (needs the hub; the tokenizer's chat template must support tools, e.g. Qwen2.5 or Qwen3):
    python examples/agent_gsm8k.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --data_file gsm8k/train.jsonl \
        --num_examples 2000 --output_dir runs/agent --per_device_train_batch_size 16 --num_generations 8 \
        --max_completion_length 512 --max_tool_calling_iterations 4 --learning_rate 1e-6

Sync mode for comparison: --cb_async_generation false. On rollout servers: --cb_server_urls http://HOST:PORT.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from datasets import Dataset
from trl import TrlParser

from trl_cb import GRPOConfig, GRPOTrainer
from trl_cb.offline.agent import agent_tokenizer, calculator, scripted_agent
from trl_cb.offline.data import GSM8KScriptArguments, load_prompts

DEFAULTS = dict(
    use_transformers_continuous_batching=True,
    cb_async_generation=True,
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=96,
    max_tool_calling_iterations=4,
    max_steps=8,
    logging_steps=1,
    learning_rate=3e-3,  # the offline task's: a real model wants ~1e-6 (the command in the module docstring)
    report_to="none",
    save_strategy="no",
)
if not torch.cuda.is_available():  # TRL defaults to bf16, which needs a GPU unless told to run on the CPU
    DEFAULTS.update(use_cpu=True, bf16=False)
SYSTEM = "Solve the problem. Use the calculator tool for arithmetic, then give the final number after '####'."


@dataclass
class AgentScriptArguments(GSM8KScriptArguments):
    """`GSM8KScriptArguments`, with the offline policy being the scripted calculator agent."""

    p_again: float = field(
        default=0.7, metadata={"help": "Scripted agent: initial chance of another call after a tool answer."}
    )
    reward: str | None = field(
        default=None,
        metadata={
            "help": "'final_answer' (the number after '####' is right: GSM8K accuracy) or 'one_call' (answered right "
            "after the first tool answer: what the scripted offline agent can learn); default: 'one_call' for the "
            "offline scripted agent, 'final_answer' for any other model."
        },
    )

    def __post_init__(self) -> None:
        if self.reward not in (None, *REWARDS):
            raise ValueError(f"--reward must be one of {sorted(REWARDS)}, got {self.reward!r}")


def final_answer_reward(completions: list[list[dict[str, Any]]], answer: list[str], **kwargs: Any) -> list[float]:
    """1 when the last assistant message's number after '####' is the answer."""
    rewards = []
    for messages, expected in zip(completions, answer, strict=True):
        text = next((str(m.get("content") or "") for m in reversed(messages) if m.get("role") == "assistant"), "")
        found = re.search(r"####\s*(-?[\d,.]+)", text)
        rewards.append(float(found is not None and found.group(1).replace(",", "").rstrip(".") == expected))
    return rewards


def answered_after_one_call(completions: list[list[dict[str, Any]]], **kwargs: Any) -> list[float]:
    """1 for a rollout that called the tool once and then answered (exactly one tool message, the last message the
    assistant's answer). Why: the scripted agent's answer never changes ("#### 24"), so it can never learn GSM8K
    accuracy; what it can learn is when to stop calling the tool, a decision its weights hold (the logit of another
    call against the answer after each tool answer, `--p_again`), through the same tool loop a real agent runs."""
    rewards = []
    for messages in completions:
        tool_rounds = sum(m.get("role") == "tool" for m in messages)
        answered = bool(messages) and messages[-1].get("role") == "assistant" and not messages[-1].get("tool_calls")
        rewards.append(float(tool_rounds == 1 and answered))
    return rewards


REWARDS = {"final_answer": final_answer_reward, "one_call": answered_after_one_call}


def main(script_args: AgentScriptArguments, training_args: GRPOConfig) -> None:
    rows = load_prompts(script_args, seed=training_args.seed)
    for row in rows:  # a system message asking for the tool
        row["prompt"] = [{"role": "system", "content": SYSTEM}, *row["prompt"]]
    model, tokenizer, reward = script_args.model_name_or_path, None, script_args.reward or "final_answer"
    if model in ("trl-cb/tiny", "tiny", "trl-cb/agent"):  # a random tiny model never writes a tool call
        tokenizer, reward = agent_tokenizer(), script_args.reward or "one_call"
        model = scripted_agent(tokenizer, p_again=script_args.p_again)
    trainer = GRPOTrainer(
        model=model, reward_funcs=REWARDS[reward], args=training_args, train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer, tools=[calculator],
    )  # fmt: skip
    trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print({k: v for k, v in entry.items() if k.startswith(("step", "tools/", "reward", "async/policy"))})


if __name__ == "__main__":
    parser = TrlParser((AgentScriptArguments, GRPOConfig))
    parser.set_defaults(**DEFAULTS)
    main(*parser.parse_args_and_config())
