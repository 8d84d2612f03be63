"""Train on trajectories that an OpenAI-client environment produced against `trl-cb serve`: the bridge from any
agent loop written for an OpenAI-compatible policy to trl_cb's IS-corrected trainer (docs/server.md, "Training on
trajectories from an OpenAI client").

The environment talks to the server with the official `openai` client, as it would to any provider; with
`return_token_ids` every answer also carries the sampled ids, their sampler-side logprobs (`policy_logprobs`) and
the weight version of each token. TRL's `rollout_func` hands them to the trainer exactly: the prompt's ids, the
completion's ids (model turns and the tool turns the chat template rendered between them), the logprobs (0 for tool
tokens), and `env_mask` (0 for tool tokens: out of the loss and of the IS weight). Later turns are sent back as ids
(`tokens`, token-in chat), so nothing is re-tokenized. Before each step the trainer pushes its weights to the server
(`trainer.cb_sync_rollout_servers()`), and every token must carry that version.

Offline (CPU, ~1 min): starts a local server on the scripted calculator agent (`trl_cb.offline.agent`):
    python examples/agent_openai_client.py --output_dir /tmp/bridge --max_steps 2

Against running servers: --cb_server_urls http://HOST:8000 --cb_server_api_key KEY --model_name_or_path M
"""

from __future__ import annotations

import json
import re
import tempfile
from contextlib import ExitStack
from typing import Any

import torch
from datasets import Dataset
from trl import TrlParser

from trl_cb import GRPOConfig, GRPOTrainer
from trl_cb.offline.agent import agent_tokenizer, calculator, scripted_agent
from trl_cb.offline.data import GSM8KScriptArguments, load_prompts

DEFAULTS = dict(
    use_transformers_continuous_batching=True,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=64,
    max_steps=2,
    logging_steps=1,
    learning_rate=1e-4,
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


def run_episode(client: Any, model: str, tokenizer: Any, prompt: list[dict], budget: int, rounds: int) -> dict:
    """One agent trajectory through the OpenAI client: turns until the model answers without a tool call, the tool
    rounds or the token budget run out. Returns its ids, logprobs, env mask and the versions that sampled it."""
    messages, prompt_ids, ids, logprobs, mask, versions = list(prompt), None, [], [], [], []
    for _ in range(rounds + 1):
        extra: dict[str, Any] = {"return_token_ids": True}
        if prompt_ids is not None:  # token-in chat: the conversation so far, exactly as sampled
            rendered = tokenizer.apply_chat_template(messages, tools=[CALCULATOR], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)  # fmt: skip
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
            break
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
    }


def openai_rollouts(url: str, api_key: str | None, model: str):  # noqa: ANN201 - TRL's RolloutFunc
    """A TRL `rollout_func`: every prompt's trajectory from the server, as the trainer needs it."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key=api_key or "none", max_retries=2)

    def rollout(prompts: list[list[dict]], trainer: Any) -> dict[str, list]:
        version = trainer.cb_sync_rollout_servers()  # this step's weights are served from here on
        budget, rounds = trainer.args.max_completion_length, trainer.args.max_tool_calling_iterations or 4
        episodes = [run_episode(client, model, trainer.processing_class, p, budget, rounds) for p in prompts]
        stale = {v for e in episodes for v in e["versions"]} - {version}
        if stale:
            raise RuntimeError(f"tokens of weight versions {sorted(stale)} in a step that pushed {version}")
        return {key: [e[key] for e in episodes] for key in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}

    return rollout


def final_answer_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """1 when the completion's last number after '####' is the answer."""
    texts = [json.dumps(c) if not isinstance(c, str) else c for c in completions]
    found = [re.findall(r"####\s*(-?[\d,.]+)", t) for t in texts]
    return [float(bool(f) and f[-1].replace(",", "").rstrip(".") == a) for f, a in zip(found, answer, strict=True)]


def main(script_args: GSM8KScriptArguments, training_args: GRPOConfig) -> None:
    from trl_cb.serving.launch import local_rollout_server

    rows = load_prompts(script_args, seed=training_args.seed)
    with ExitStack() as stack:
        tokenizer, model, name = None, script_args.model_name_or_path, script_args.model_name_or_path
        if not training_args.cb_server_urls:  # offline: a local server on the scripted calculator agent
            tokenizer, directory = agent_tokenizer(), stack.enter_context(tempfile.TemporaryDirectory())
            model = scripted_agent(tokenizer, p_again=0.3, margin=8.0)  # ~15% of tokens off-script: real sampling
            model.save_pretrained(directory)
            tokenizer.save_pretrained(directory)
            server = stack.enter_context(local_rollout_server(directory, threads=1))
            training_args.cb_server_urls, name = [server.url], directory
        url, key = training_args.cb_server_urls[0], training_args.cb_server_api_key
        trainer = GRPOTrainer(
            model=model, reward_funcs=final_answer_reward, args=training_args, train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer, rollout_func=openai_rollouts(url, key, name),
        )  # fmt: skip
        trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print({k: v for k, v in entry.items() if k.startswith(("step", "reward", "sampling/sampling_logp"))})


if __name__ == "__main__":
    parser = TrlParser((GSM8KScriptArguments, GRPOConfig))
    parser.set_defaults(**DEFAULTS)
    main(*parser.parse_args_and_config())
