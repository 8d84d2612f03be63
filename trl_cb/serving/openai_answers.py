"""OpenAI's answer objects as the rollout server builds them (`openai_serving.py`): completion and chat choices,
stream chunks and usage, from decoded samples (`DecodedSample`). The requests they answer: `openai_protocol.py`.

Shapes: OpenAI's (`text` / `message`, `logprobs` as `{tokens, token_logprobs, top_logprobs, text_offset}` or
`{content: [{token, logprob, bytes, top_logprobs}]}`, `finish_reason`, `usage`), with, when the request set
`return_token_ids`, the RL fields (`openai_protocol.py`'s docstring); `dump` leaves the RL fields out where unset.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "RL_FIELDS",
    "DecodedSample",
    "chat_choice",
    "chat_chunk",
    "chat_logprobs",
    "chat_delta",
    "completion_choice",
    "completion_chunk",
    "dump",
    "response_head",
    "rl_fields",
    "usage",
]

#: Response fields OpenAI does not define: left out when unset, so that strict clients see OpenAI's objects.
RL_FIELDS = frozenset({"token_ids", "prompt_token_ids", "policy_logprobs", "token_weight_versions", "weight_version",
                       "stop_reason"})  # fmt: skip


@dataclass
class DecodedSample:
    """One finished (or streamed) sample, decoded: the tokens it keeps (through the one that completed a stop
    string), their values, and their text."""

    token_ids: list[int]
    logprobs: list[float]
    policy_logprobs: list[float]
    versions: list[int]
    pieces: list[str]  # per token: its share of the text
    offsets: list[int]  # per token: where its share starts
    token_bytes: list[bytes]  # per token: its own bytes (`detokenize.TokenBytes`; "" share, bytes all the same)
    text: str  # what the client sees (cut before a stop string, unless `include_stop_str_in_output`)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string, or the stop token id (vLLM's)
    weight_version: int | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # chat: parsed OpenAI tool calls
    content: str | None = None  # chat: the message's text once tool calls are parsed out
    #: per token (asked with `logprobs: k` / `top_logprobs: k`): the k likeliest tokens, as (text, logprob, bytes)
    alternatives: list[list[tuple[str, float, bytes | None]]] | None = None


def rl_fields(sample: DecodedSample, rl: bool) -> dict[str, Any]:
    if not rl:
        return {"weight_version": sample.weight_version}
    return {
        "token_ids": sample.token_ids,
        "policy_logprobs": sample.policy_logprobs,
        "token_weight_versions": sample.versions,
        "weight_version": sample.weight_version,
    }


def completion_choice(index: int, sample: DecodedSample, logprobs: bool, rl: bool, prompt: list[int] | None) -> dict:
    """An OpenAI completion choice (also a stream chunk's choice, for a sample's next tokens)."""
    values = None
    if logprobs:
        values = {
            "tokens": sample.pieces,
            "token_logprobs": sample.logprobs,
            "top_logprobs": _completion_top(sample),
            "text_offset": sample.offsets,
        }
    choice = {"index": index, "text": sample.text, "logprobs": values, "finish_reason": sample.finish_reason}
    choice.update(stop_reason=sample.stop_reason, **rl_fields(sample, rl))
    if rl and prompt is not None:
        choice["prompt_token_ids"] = prompt
    return choice


def _completion_top(sample: DecodedSample) -> list[dict[str, float]]:
    """Per token, vLLM's completion `top_logprobs`: the sampled token's text and logprob, then its alternatives'."""
    if sample.alternatives is None:
        return [{piece: lp} for piece, lp in zip(sample.pieces, sample.logprobs)]
    tops = []
    for piece, lp, alternatives in zip(sample.pieces, sample.logprobs, sample.alternatives, strict=True):
        top = {piece: lp}
        for text, value, _ in alternatives:
            top.setdefault(text, value)
        tops.append(top)
    return tops


def chat_logprobs(sample: DecodedSample) -> dict:
    """OpenAI's `{content: [{token, logprob, bytes, top_logprobs}]}`: `token` is the token's share of the text (the
    tokens concatenate to the content), `bytes` its own bytes (they concatenate to the content's UTF-8, also where a
    token ends inside a character and its share is "")."""
    content = [
        {"token": piece, "logprob": lp, "bytes": list(own), "top_logprobs": []}
        for piece, lp, own in zip(sample.pieces, sample.logprobs, sample.token_bytes)
    ]
    for entry, alternatives in zip(content, sample.alternatives or [], strict=False):
        entry["top_logprobs"] = [
            {"token": text, "logprob": value, "bytes": None if own is None else list(own)}
            for text, value, own in alternatives
        ]
    return {"content": content}


def chat_choice(index: int, sample: DecodedSample, logprobs: bool, rl: bool) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": sample.content}
    if sample.tool_calls:
        message["tool_calls"] = sample.tool_calls
    choice = {"index": index, "message": message, "logprobs": chat_logprobs(sample) if logprobs else None}
    choice.update(finish_reason=sample.finish_reason, stop_reason=sample.stop_reason, **rl_fields(sample, rl))
    return choice


def chat_delta(index: int, sample: DecodedSample, logprobs: bool, rl: bool, first: bool) -> dict:
    """A stream chunk's choice: `sample` holds only the new tokens (and their text, or the parsed message at the
    end when tools were offered)."""
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if sample.content:
        delta["content"] = sample.content
    if sample.tool_calls:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(sample.tool_calls)]
    choice = {"index": index, "delta": delta, "logprobs": chat_logprobs(sample) if logprobs else None}
    choice.update(finish_reason=sample.finish_reason, stop_reason=sample.stop_reason, **rl_fields(sample, rl))
    return choice


def response_head(kind: str, model: str) -> dict[str, Any]:
    """`id`, `object`, `created`, `model` of a response (`kind`: `text_completion`, `chat.completion` or
    `chat.completion.chunk`)."""
    prefix = "cmpl" if kind == "text_completion" else "chatcmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model}


def completion_chunk(head: dict[str, Any], choices: list[dict], usage: dict | None = None) -> dict:
    return {**head, "choices": choices, **({"usage": usage} if usage is not None else {})}


def chat_chunk(head: dict[str, Any], choices: list[dict], usage: dict | None = None) -> dict:
    return {**head, "object": "chat.completion.chunk", "choices": choices, **({"usage": usage} if usage else {})}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}


def dump(body: dict[str, Any]) -> bytes:
    """JSON of a response or chunk, RL fields left out where unset (recursively through `choices`): the bytes of
    `json.dumps(body, separators=(",", ":"))`, written one object of a list of objects (a choice) at a time.

    Why in pieces: one `json.dumps` call holds the GIL from start to end, so on a large answer (hundreds of
    milliseconds for 128 samples of 256 tokens with logprobs) it would stall every other thread, the server's event
    loop included, wherever it runs; between two choices the interpreter can hand it over (`openai_serving.py`)."""
    parts = []
    for key, value in _without_unset(body).items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            encoded = b"[" + b",".join(map(_json, value)) + b"]"
        else:
            encoded = _json(value)
        parts.append(_json(key) + b":" + encoded)
    return b"{" + b",".join(parts) + b"}"


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _without_unset(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_unset(v) for k, v in value.items() if not (k in RL_FIELDS and v is None)}
    if isinstance(value, list):
        return [_without_unset(v) for v in value]
    return value
