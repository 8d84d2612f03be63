"""Binary answers (`encoding="binary"`, `serving/frames.py`): values round-trip bit for bit (int32 ids and versions,
fp32 logprobs, -inf included) on ragged choices whatever the byte stream's chunking; a truncated or malformed frame
raises `FrameError` naming the problem (never a short read); over a real server process (the payload benchmark's
fake engine, whose answers are known here), binary answers hold exactly the engine's values, JSON answers still work
for clients that do not ask for frames, and the trainer's inputs built from JSON and binary answers are identical
(control: one corrupted array byte makes them differ)."""

from __future__ import annotations

import importlib.util
import math
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import torch
from transformers import GenerationConfig

from trl_cb.errors import RolloutServerError
from trl_cb.rollouts.rollout_groups import as_lists, oldest_version
from trl_cb.serving import client as client_module
from trl_cb.serving.client import RolloutClient
from trl_cb.serving.frames import FRAMES_MEDIA_TYPE, FrameError, decode_frame, frame_pieces, read_frames
from trl_cb.serving.protocol import PackedColumns, value_runs
from trl_cb.trainers.is_correction import padded_sampling_logps
from trl_cb.trainers.remote import RemoteRollouts

ROOT = Path(__file__).resolve().parents[3]
PROMPTS, N, TOKENS = 6, 2, 40  # the fake engine's answer: PROMPTS groups of N completions of TOKENS tokens


def _fp32(values: torch.Tensor) -> list[float]:
    return values.float().tolist()  # fp32 values as Python floats, as the engine hands them over


def _choices() -> list[dict]:
    """Ragged choices: empty, one token, a long one with three version runs, a -inf logprob, policy logprobs equal to
    the logprobs (one list object or an equal copy) and different from them."""
    gen = torch.Generator().manual_seed(0)
    lengths = [0, 1, 8192, 37, 0, 5]
    choices = []
    for c, n in enumerate(lengths):
        logprobs = _fp32(torch.log_softmax(torch.randn(max(n, 1), generator=gen), -1))[:n]
        versions = [2] * (n // 3) + [3] * (n // 3) + [7] * (n - 2 * (n // 3))
        policy = logprobs if c % 3 == 0 else list(logprobs) if c % 3 == 1 else _fp32(torch.randn(n, generator=gen))
        choices.append(
            {
                "token_ids": torch.randint(0, 2**31 - 1, (n,), generator=gen).tolist(),
                "logprobs": logprobs,
                "policy_logprobs": policy,
                "token_weight_versions": versions,
                "index": c,
                "prompt_index": c // 2,
                "weight_version": min(versions, default=1),
                "finish_reason": "stop" if c % 2 else "length",
            }
        )
    choices[3]["logprobs"][4] = -math.inf
    return choices


def test_version_runs_of_any_list():
    assert value_runs([]) == ([], [])
    assert value_runs([4] * 5 + [6] * 3) == ([4, 6], [5, 3])
    assert value_runs([1, 0, 0, 1, 1, 0]) == ([1, 0, 1, 0], [1, 2, 2, 1])  # not nondecreasing: still exact


def _columns(choices: list[dict]) -> PackedColumns:
    columns = PackedColumns()
    for c in choices:
        scalars = {k: c[k] for k in ("index", "prompt_index", "weight_version", "finish_reason")}
        runs = value_runs(c["token_weight_versions"])
        columns.add(c["token_ids"], c["logprobs"], c["policy_logprobs"], runs, **scalars)
    return columns


def _frame(choices: list[dict] | None = None, **header) -> bytes:
    columns = _columns(choices) if choices is not None else None
    return b"".join(frame_pieces(header or {"prompt_index": 0}, columns))


def _bits(values) -> bytes:
    values = values.tolist() if isinstance(values, torch.Tensor) else values
    return struct.pack(f"<{len(values)}f", *values)


@pytest.mark.parametrize("chunk", [1, 7, 4096, None], ids=["bytewise", "odd", "4k", "whole"])
def test_round_trip_is_exact_on_ragged_choices(chunk):
    choices = _choices()
    raw = _frame(choices, id="x", model="m", usage={"total_tokens": 3})
    pieces = [raw] if chunk is None else [raw[i : i + chunk] for i in range(0, len(raw), chunk)]
    (frame,) = read_frames(pieces)
    header, got = decode_frame(frame)
    assert (header.id, header.model, header.usage) == ("x", "m", {"total_tokens": 3})
    assert len(got) == len(choices)
    for sent, choice in zip(choices, got):
        assert choice.token_ids.dtype == torch.int32 and choice.logprobs.dtype == torch.float32
        assert choice.token_ids.tolist() == sent["token_ids"]
        assert choice.token_weight_versions.tolist() == sent["token_weight_versions"]
        assert _bits(choice.logprobs) == _bits(sent["logprobs"])  # bit-exact fp32, the -inf too
        assert _bits(choice.policy_logprobs) == _bits(sent["policy_logprobs"])
        scalars = ("index", "prompt_index", "weight_version", "finish_reason")
        assert [getattr(choice, k) for k in scalars] == [sent[k] for k in scalars]
    assert math.isinf(got[3].logprobs[4].item())


def test_frames_follow_each_other_and_policy_logprobs_equal_to_the_logprobs_are_sent_once():
    same = [c for c in _choices() if c["index"] % 3 != 2]  # policy logprobs equal to the logprobs everywhere
    raw = _frame(same) + _frame(_choices()) + _frame(None, error="boom", status=500)
    first, second, error = read_frames([raw])
    assert len(first) < len(second)  # the first frame carries two arrays, the second three
    assert decode_frame(first)[0].choices.policy_logprobs_sent is False
    assert decode_frame(second)[0].choices.policy_logprobs_sent is True
    header, choices = decode_frame(error)
    assert choices == [] and (header.error, header.status) == ("boom", 500)


def _patched(raw: bytes, offset: int, value: bytes) -> bytes:
    return raw[:offset] + value + raw[offset + len(value) :]


def test_truncated_and_malformed_frames_raise():
    raw = _frame(_choices())
    assert len(decode_frame(next(read_frames([raw])))[1]) == 6  # control: the intact frame decodes
    for cut in (1, 4, len(raw) - 17, len(raw) - 10):  # inside the arrays, the header, the prefix
        with pytest.raises(FrameError, match="truncated frame"):
            list(read_frames([raw[:-cut]]))
    with pytest.raises(FrameError, match="not a trl_cb frame"):
        list(read_frames([b'{"id": "x", "choices": []}' + b" " * 16]))
    with pytest.raises(FrameError, match="truncated frame"):  # a whole frame, then part of the next
        list(read_frames([raw, raw[:100]]))
    header_bytes, array_bytes = struct.unpack_from("<IQ", raw, 4)
    longer = _patched(raw, 8, struct.pack("<Q", array_bytes + 4)) + b"\0" * 4  # a frame of the claimed size
    with pytest.raises(FrameError, match="frame arrays hold"):
        decode_frame(next(read_frames([longer])))
    header = raw[16 : 16 + header_bytes]
    shifted = header.replace(b'"num_tokens":[0,1,', b'"num_tokens":[1,0,')  # same total: runs no longer fit
    assert shifted != header
    with pytest.raises(FrameError, match="version runs cover"):
        decode_frame(next(read_frames([raw[:16] + shifted + raw[16 + header_bytes :]])))
    garbage = b"{" + b"x" * (header_bytes - 1)
    with pytest.raises(FrameError, match="frame header"):
        decode_frame(next(read_frames([raw[:16] + garbage + raw[16 + header_bytes :]])))
    error = _frame(None, error="x", status=500)
    with pytest.raises(FrameError, match="without choices carries"):
        decode_frame(next(read_frames([_patched(error, 8, struct.pack("<Q", 4)) + b"\0" * 4])))


# --------------------------------------------------------------------------------- over a real server process


def _benchmark() -> object:
    """benchmarks/server.py, whose `--serve-fake` server is a real app on uvicorn with a fake engine."""
    spec = importlib.util.spec_from_file_location("server_benchmark", ROOT / "benchmarks" / "server.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fake():
    """(URL of a fake-engine server, the benchmark module); the engine answers prompt p's group with
    `fake_group(prompt, N, TOKENS, p)`."""
    benchmark = _benchmark()
    with benchmark.fake_server() as url:
        yield url, benchmark


def _client(url: str, encoding: str) -> RolloutClient:
    client = RolloutClient([url], timeout=120, retries=0, encoding=encoding)
    client.known_versions.add(1)  # the fake groups switch to version 1 halfway
    return client


def test_binary_answers_hold_the_engines_values_exactly(fake):
    url, benchmark = fake
    prompts = [[5] * 8] * PROMPTS
    expected = [benchmark.fake_group(p, N, TOKENS, seed) for seed, p in enumerate(prompts)]
    client = _client(url, "binary")
    result = client.generate(prompts, N, max_tokens=TOKENS)
    streamed = {}
    client.stream_generate(prompts, N, lambda i, group: streamed.setdefault(i, group), max_tokens=TOKENS)
    assert sorted(streamed) == list(range(PROMPTS))
    for i, group in enumerate(expected):
        for k in range(N):
            for got in (result, streamed[i]):
                row = i * N + k if got is result else k
                assert got.completion_ids[row].tolist() == group.completion_ids[k]
                assert _bits(got.logprobs[row]) == _bits(group.logprobs[k])
                assert _bits(got.policy_logprobs[row]) == _bits(group.policy_logprobs[k])
                assert got.token_weight_versions[row].tolist() == group.versions[k]
                assert got.weight_versions[row] == 0


def test_json_stays_the_default_for_clients_that_do_not_ask(fake):
    url, _ = fake
    body = {"prompt": [[5] * 8] * 2, "n": N, "max_tokens": TOKENS, "return_token_ids": True}
    answer = requests.post(url + "/v1/completions", json=body, timeout=120)
    assert answer.headers["Content-Type"] == "application/json"
    choices = answer.json()["choices"]  # OpenAI's completion choices, the RL fields beside them
    assert len(choices) == 2 * N and len(choices[0]["token_ids"]) == TOKENS
    binary = requests.post(url + "/v1/completions", json={**body, "encoding": "binary"}, timeout=120)
    assert binary.headers["Content-Type"] == FRAMES_MEDIA_TYPE
    (frame,) = read_frames([binary.content])
    assert [c.token_ids.tolist() for c in decode_frame(frame)[1]] == [c["token_ids"] for c in choices]
    stream = requests.post(url + "/v1/completions/stream", json=body, timeout=120)
    assert stream.headers["Content-Type"] == "application/x-ndjson" and stream.text.count("\n") == 2


class _Trainer:
    """What the trainer's side of server rollouts (one process) reads of a trainer, with a real client."""

    def __init__(self, client: RolloutClient) -> None:
        self.accelerator = SimpleNamespace(num_processes=1, process_index=0, is_main_process=True)
        self.args = SimpleNamespace(report_to=[], cb_async_generation=False)
        self.state = SimpleNamespace(global_step=0)
        self.generation_config = GenerationConfig(max_new_tokens=TOKENS, temperature=1.0)
        self.rollouts = SimpleNamespace(remote=RemoteRollouts(self))
        remote = self.rollouts.remote
        remote.connected, remote.pushed_step = True, 0  # connected, weights current: generation only
        remote.client = client


def _batch(url: str, encoding: str) -> dict:
    """What the trainers consume from one round: the ids and GRPO's sampling logprobs as TRL's lists, the padded
    (B, T) sampling logprobs the IS correction reads, and each completion's oldest version."""
    client = _client(url, encoding)
    trainer = _Trainer(client)
    prompts = [[5] * 8] * PROMPTS
    ids, logprobs = trainer.rollouts.remote.generate(prompts)
    padded = torch.zeros(len(ids), TOKENS + 3, dtype=torch.long)  # TRL pads the completion ids past the longest
    sampling = padded_sampling_logps({"completion_ids": padded}, logprobs)
    versions = client.generate(prompts, 1, max_tokens=TOKENS).token_weight_versions
    return {
        "ids": ids,
        "grpo_logprobs": [_bits(row) for row in as_lists(logprobs)],
        "sampling_logps": sampling.numpy().tobytes(),
        "oldest": [oldest_version([v], -1) for v in versions],
    }


def test_the_trainer_gets_identical_batches_through_json_and_binary(fake, monkeypatch):
    url, _ = fake
    from_json, from_binary = _batch(url, "json"), _batch(url, "binary")
    assert all(isinstance(row, list) and isinstance(row[0], int) for row in from_binary["ids"])
    assert from_binary == from_json
    assert from_binary["oldest"] == [0] * PROMPTS

    real = client_module.read_frames

    def corrupted(pieces):  # a bit of the last fp32 logprob flipped: still a well-formed frame
        for frame in real(pieces):
            frame[-1] ^= 1
            yield frame

    monkeypatch.setattr(client_module, "read_frames", corrupted)
    assert _batch(url, "binary")["grpo_logprobs"] != from_json["grpo_logprobs"]  # control: the check can fail


def test_a_truncated_answer_is_a_clear_client_error(fake, monkeypatch):
    url, _ = fake
    real = client_module.read_frames
    monkeypatch.setattr(client_module, "read_frames", lambda pieces: real([b"".join(pieces)[:-5]]))
    client = _client(url, "binary")
    with pytest.raises(RolloutServerError, match="truncated frame"):
        client.generate([[5] * 8], N, max_tokens=TOKENS)
    with pytest.raises(RolloutServerError, match="truncated frame"):
        client.stream_generate([[5] * 8], N, lambda i, group: None, max_tokens=TOKENS)
