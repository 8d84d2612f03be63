"""Train on trajectories that an OpenAI-client environment produced against `trl-cb serve`: the bridge from any
agent loop written for an OpenAI-compatible policy to trl_cb's IS-corrected trainer (docs/server.md, "Training on
trajectories from an OpenAI client").

The environment talks to the server with the official `openai` client, as it would to any provider; with
`return_token_ids` every answer also carries the sampled ids, their sampler-side logprobs (`policy_logprobs`) and the
weight version of each token. TRL's `rollout_func` hands them to the trainer exactly: the prompt's ids, the
completion's ids (model turns and the tool turns the chat template rendered between them), the logprobs (0 for tool
tokens), and `env_mask` (0 for tool tokens: out of the loss and of the IS weight). Later turns are sent back as ids
(`tokens`, token-in chat), so nothing is re-tokenized; the tool turns between them are the server's own rendering
(`/tokenize`), so a client tokenizer that splits text differently cannot break the conversation. Before each step the
trainer pushes its weights to the server (`trainer.cb_sync_rollout_servers()`), and every token must carry that
version.

Offline (CPU, ~50 s on 2 cores): starts a local server on the scripted calculator agent (`trl_cb.offline.agent`: it
calls the calculator, then after each tool answer calls it again with probability --p_again, 0.7, or answers):
    python examples/agent_openai_client.py --output_dir /tmp/bridge

The scripted answer is always "#### 24", so GSM8K accuracy cannot be learned offline; the offline reward (`--reward
one_call`) is 1 for an episode that calls the tool once and then answers, and learning means the policy stops calling
the tool again (as `examples/agent_gsm8k.py` offline). The default run (10 steps of 2 prompts x 4 episodes, lr 3e-3)
shows it. Measured 2026-11-28 on a 2-core CPU shared with other jobs, seeds 0-2 (`--seed`; seed 0 twice): `reward` at
step 1 -> step 10: 0.25 -> 1.0, 0.5 -> 1.0, 0.125 -> 1.0, 0.125 -> 1.0 (1.0 from step 4-5 on in every run);
`sampling/sampling_logp_difference/max` at most 3.0e-5; whole command 48-52 s (training ~20 s of it; the rest imports
and starting the server). The server's sampling is not seeded per request, so two runs of one seed differ step by step.
With `--margin 12` (fewer near-certain tokens) and lr 5e-3 one run in four collapsed (reward 0 from step 5 on: the
first call broke, so every reward and the gradient were 0); the default margin (40) did not.

Against running servers: --cb_server_urls http://HOST:8000 --cb_server_api_key KEY --model_name_or_path M
"""

from __future__ import annotations

import json
import re
import tempfile
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
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
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=64,
    max_steps=10,
    logging_steps=1,
    learning_rate=3e-3,  # the offline task's (module docstring): a real model wants ~1e-6
    report_to="none",
    save_strategy="no",
)
if not torch.cuda.is_available():  # TRL defaults to bf16, which needs a GPU unless told to run on the CPU
    DEFAULTS.update(use_cpu=True, bf16=False)
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def run_episode(
    client: Any, model: str, tokenize: Callable[[list[dict]], list[int]], prompt: list[dict], budget: int, rounds: int
) -> dict:
    """One agent trajectory through the OpenAI client: turns until the model answers without a tool call, the tool
    rounds or the token budget run out. Returns its ids, logprobs, env mask and the versions that sampled it, and
    its tool rounds and whether it ended with an answer (for the reward). `tokenize`: the conversation as the server
    renders it for generation (`/tokenize`)."""
    messages, prompt_ids, ids, logprobs, mask, versions = list(prompt), None, [], [], [], []
    tool_rounds, answered = 0, False
    for _ in range(rounds + 1):
        extra: dict[str, Any] = {"return_token_ids": True}
        if prompt_ids is not None:  # token-in chat: the conversation so far, exactly as sampled
            rendered = tokenize(messages)  # the server's own rendering: its tokenizer is the one that counts
            context = prompt_ids + ids
            suffix = list(rendered)[len(context) :] if list(rendered)[: len(context)] == context else None
            if suffix is None or len(ids) + len(suffix) >= budget:
                break  # the template is not prefix-preserving here, or no room left: the episode ends
            ids, logprobs, mask = ids + suffix, logprobs + [0.0] * len(suffix), mask + [0] * len(suffix)
            versions += [versions[-1]] * len(suffix)
            extra["tokens"] = prompt_ids + ids
        left = budget - len(ids)
        answer = client.chat.completions.create(
            model=model, messages=messages, tools=[CALCULATOR], max_completion_tokens=left, extra_body=extra
        )
        choice, rl = answer.choices[0], answer.choices[0].model_extra
        prompt_ids = prompt_ids if prompt_ids is not None else answer.model_extra["prompt_token_ids"]
        ids += rl["token_ids"]
        logprobs += rl["policy_logprobs"]  # the trainer's quantity: log_softmax(logits / T) of each sampled token
        mask += [1] * len(rl["token_ids"])
        versions += rl["token_weight_versions"]
        calls = choice.message.tool_calls or []
        if not calls:
            answered = choice.finish_reason == "stop"  # the model ended its turn (not cut by the token budget)
            break
        tool_rounds += 1
        messages.append({"role": "assistant", "content": "", "tool_calls": [c.model_dump() for c in calls]})
        for call in calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except Exception as exc:  # TRL's semantics: the error is the tool's answer
                result = str({"error": str(exc)})
            messages.append({"role": "tool", "name": call.function.name, "tool_call_id": call.id, "content": result})
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": ids,
        "logprobs": logprobs,
        "env_mask": mask,
        "versions": versions,
        "tool_rounds": tool_rounds,
        "answered": answered,
    }


def openai_rollouts(url: str, api_key: str | None, model: str):  # noqa: ANN201 - TRL's RolloutFunc
    """A TRL `rollout_func`: every prompt's trajectory from the server, as the trainer needs it."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key=api_key or "none", max_retries=2)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}

    def tokenize(messages: list[dict]) -> list[int]:
        """vLLM's `/tokenize` on the server: the ids it would generate from, to append to (not a local rendering: a
        tokenizer loaded elsewhere may split the same text differently, and then no turn would match the last)."""
        body = json.dumps({"model": model, "messages": messages, "tools": [CALCULATOR]}).encode()
        request = urllib.request.Request(url + "/tokenize", data=body, headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.load(answer)["tokens"]

    def rollout(prompts: list[list[dict]], trainer: Any) -> dict[str, list]:
        version = trainer.cb_sync_rollout_servers()  # this step's weights are served from here on
        budget, rounds = trainer.args.max_completion_length, trainer.args.max_tool_calling_iterations or 4
        episodes = [run_episode(client, model, tokenize, p, budget, rounds) for p in prompts]
        stale = {v for e in episodes for v in e["versions"]} - {version}
        if stale:
            raise RuntimeError(f"tokens of weight versions {sorted(stale)} in a step that pushed {version}")
        keys = ("prompt_ids", "completion_ids", "logprobs", "env_mask", "tool_rounds", "answered")
        return {key: [e[key] for e in episodes] for key in keys}  # extra keys reach the reward functions

    return rollout


def final_answer_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """1 when the completion's last number after '####' is the answer."""
    texts = [json.dumps(c) if not isinstance(c, str) else c for c in completions]
    found = [re.findall(r"####\s*(-?[\d,.]+)", t) for t in texts]
    return [float(bool(f) and f[-1].replace(",", "").rstrip(".") == a) for f, a in zip(found, answer, strict=True)]


def answered_after_one_call(
    completions: list[Any], tool_rounds: list[int], answered: list[bool], **kwargs: Any
) -> list[float]:
    """1 for an episode that called the tool once, then ended its turn without another call (`run_episode` counts
    both). Why: the scripted agent's answer never changes ("#### 24"), so it can never learn GSM8K accuracy; what it
    can learn is to make the call cleanly and then stop calling (the logits its weights hold), through the same
    client, server and rollout_func a real agent uses."""
    return [float(rounds == 1 and done) for rounds, done in zip(tool_rounds, answered, strict=True)]


REWARDS = {"final_answer": final_answer_reward, "one_call": answered_after_one_call}


@dataclass
class BridgeScriptArguments(GSM8KScriptArguments):
    """`GSM8KScriptArguments`, with the offline policy being the scripted calculator agent on a local server."""

    p_again: float = field(
        default=0.7, metadata={"help": "Scripted agent: initial chance of another call after a tool answer."}
    )
    margin: float = field(
        default=40.0,
        metadata={
            "help": "Scripted agent: logit margin of each scripted token (40: only the call-or-answer choice is "
            "random; 8: about 1 token in 7 off-script, and the task learns too slowly for the default run; 12: about "
            "1 in 300, and a run can collapse: the first call breaks, every reward is 0, the gradient with it)."
        },
    )
    reward: str | None = field(
        default=None,
        metadata={
            "help": "'final_answer' (the number after '####' is right: GSM8K accuracy) or 'one_call' (one tool call, "
            "then an answer: what the scripted offline agent can learn); default: 'one_call' offline, "
            "'final_answer' against --cb_server_urls."
        },
    )

    def __post_init__(self) -> None:
        if self.reward not in (None, *REWARDS):
            raise ValueError(f"--reward must be one of {sorted(REWARDS)}, got {self.reward!r}")


def main(script_args: BridgeScriptArguments, training_args: GRPOConfig) -> None:
    from trl_cb.serving.launch import local_rollout_server

    rows = load_prompts(script_args, seed=training_args.seed)
    with ExitStack() as stack:
        tokenizer, model, name = None, script_args.model_name_or_path, script_args.model_name_or_path
        reward = script_args.reward or "final_answer"
        if not training_args.cb_server_urls:  # offline: a local server on the scripted calculator agent
            tokenizer, directory = agent_tokenizer(), stack.enter_context(tempfile.TemporaryDirectory())
            reward = script_args.reward or "one_call"
            # the server really samples the call-or-answer choice (log 0.7 / log 0.3 at the start): the logprob check
            # in the printed steps (`sampling_logp_difference`) is not about near-certain tokens only
            model = scripted_agent(tokenizer, p_again=script_args.p_again, margin=script_args.margin)
            model.save_pretrained(directory)
            tokenizer.save_pretrained(directory)
            server = stack.enter_context(local_rollout_server(directory, threads=1))
            training_args.cb_server_urls, name = [server.url], directory
        url, key = training_args.cb_server_urls[0], training_args.cb_server_api_key
        trainer = GRPOTrainer(
            model=model, reward_funcs=REWARDS[reward], args=training_args, train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer, rollout_func=openai_rollouts(url, key, name),
        )  # fmt: skip
        trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print({k: v for k, v in entry.items() if k.startswith(("step", "reward", "sampling/sampling_logp"))})


if __name__ == "__main__":
    parser = TrlParser((BridgeScriptArguments, GRPOConfig))
    parser.set_defaults(**DEFAULTS)
    main(*parser.parse_args_and_config())
