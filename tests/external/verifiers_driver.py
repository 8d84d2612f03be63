"""Run by a Python that has `verifiers` (0.4) installed, not by trl_cb's: its own clients, unmodified, against a
running `trl-cb serve`. Prints one JSON object: the training client's token-in turns (vLLM `/inference/v1/generate`:
prompt ids, completion ids and logprobs) and the evaluation client's chat turns (a tool offered, then its result).

Usage: python verifiers_driver.py BASE_URL MODEL API_KEY
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from verifiers.v1.clients.eval import EvalClient
from verifiers.v1.clients.train import TrainClient
from verifiers.v1.configs.client import EvalClientConfig, TrainClientConfig
from verifiers.v1.dialects.chat import ChatDialect
from verifiers.v1.types import SamplingConfig

PROMPTS = ["What is 2 + 3?", "Name a colour.", "Count to three."]
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


async def main(url: str, model: str) -> dict:
    train = TrainClient(TrainClientConfig(base_url=url, api_key_var="TRL_CB_KEY", renderer_model_name=model))
    turns = []
    for text in PROMPTS:
        body = {"model": model, "messages": [{"role": "user", "content": text}]}
        response = await train.get_response(ChatDialect(), body, SamplingConfig(temperature=1.0, max_tokens=12))
        turns.append({"finish_reason": response.finish_reason, **response.tokens.model_dump()})
    await train.close()
    evaluate = EvalClient(EvalClientConfig(base_url=url, api_key_var="TRL_CB_KEY"))
    asked = [{"role": "user", "content": "What is 2 + 3? Use the tool."}]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    answered = [*asked, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "5"}]  # fmt: skip
    chats = []
    for messages in (asked, answered):
        body = {"model": model, "messages": messages, "tools": [ADD], "max_tokens": 8, "temperature": 1.0}
        response = await evaluate.get_response(ChatDialect(), body, SamplingConfig())
        chats.append({"finish_reason": response.finish_reason, "content": response.message.content})
    await evaluate.close()
    return {"train": turns, "eval": chats}


if __name__ == "__main__":
    base_url, model_name, key = sys.argv[1:4]
    os.environ["TRL_CB_KEY"] = key
    print(json.dumps(asyncio.run(main(base_url, model_name))))
