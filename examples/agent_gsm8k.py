"""GRPO on GSM8K with a calculator tool, multi-turn and async: each sample's tool loop runs in the rollout producer
while other samples generate and the trainer trains (docs/async.md, "Multi-turn: tools and environments").

Offline (CPU, seconds): a scripted tool-calling tiny policy (`trl_cb.offline.agent`: it calls the calculator, then
calls it again with probability --p_again or answers), the GSM8K test split shipped with trl_cb:
    python examples/agent_gsm8k.py --output_dir /tmp/agent --max_steps 4

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
    max_steps=2,
    logging_steps=1,
    learning_rate=1e-4,
    report_to="none",
    save_strategy="no",
)
if not torch.cuda.is_available():  # TRL defaults to bf16, which needs a GPU unless told to run on the CPU
    DEFAULTS.update(use_cpu=True, bf16=False)
SYSTEM = "Solve the problem. Use the calculator tool for arithmetic, then give the final number after '####'."


@dataclass
class AgentScriptArguments(GSM8KScriptArguments):
    """`GSM8KScriptArguments`, with the offline policy being the scripted calculator agent."""

    p_again: float = field(default=0.3, metadata={"help": "Scripted agent: chance of another call after an answer."})


def final_answer_reward(completions: list[list[dict[str, Any]]], answer: list[str], **kwargs: Any) -> list[float]:
    """1 when the last assistant message's number after '####' is the answer."""
    rewards = []
    for messages, expected in zip(completions, answer, strict=True):
        text = next((str(m.get("content") or "") for m in reversed(messages) if m.get("role") == "assistant"), "")
        found = re.search(r"####\s*(-?[\d,.]+)", text)
        rewards.append(float(found is not None and found.group(1).replace(",", "").rstrip(".") == expected))
    return rewards


def main(script_args: AgentScriptArguments, training_args: GRPOConfig) -> None:
    rows = load_prompts(script_args, seed=training_args.seed)
    for row in rows:  # a system message asking for the tool
        row["prompt"] = [{"role": "system", "content": SYSTEM}, *row["prompt"]]
    model, tokenizer = script_args.model_name_or_path, None
    if model in ("trl-cb/tiny", "tiny", "trl-cb/agent"):  # a random tiny model never writes a tool call
        tokenizer = agent_tokenizer()
        model = scripted_agent(tokenizer, p_again=script_args.p_again)
    trainer = GRPOTrainer(
        model=model, reward_funcs=final_answer_reward, args=training_args, train_dataset=Dataset.from_list(rows),
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
