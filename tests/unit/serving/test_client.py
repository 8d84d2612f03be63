"""`RolloutClient` against transient faults, with a real server process behind a flaky front on loopback: a 502/503
is retried (bounded, with backoff) before the replica counts as failed, a replica that keeps failing is left for the
others, and an answer that breaks the protocol raises `RolloutServerError` (never an `AssertionError` or `KeyError`).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import threading

import pytest
import requests
import torch

from tests.unit.serving.conftest import KEY
from trl_cb.errors import RolloutServerError
from trl_cb.serving.client import RolloutClient

#: The checkpoint's EOS logit bias (conftest's `checkpoint`): completions end early, lengths vary.
EOS_LOGIT_BIAS = 4.0


@contextlib.contextmanager
def front(target: str | None, failures: int, answer: dict | None = None):
    """An HTTP front on a free loopback port: the first `failures` POSTs get 503, later ones are forwarded to `target`
    (or answered 200 with `answer`). Yields (url, seen), `seen` counting the POSTs it received."""
    seen = {"posts": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen["posts"] += 1
            if seen["posts"] <= failures:
                self._reply(503, b'{"detail": "overloaded"}')
            elif answer is not None:
                self._reply(200, json.dumps(answer).encode())
            else:
                headers = {"Authorization": self.headers["Authorization"], "Content-Type": "application/json"}
                forwarded = requests.post(target + self.path, data=body, headers=headers, timeout=60)
                self._reply(forwarded.status_code, forwarded.content, forwarded.headers["Content-Type"])

        def _reply(self, status: int, payload: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def test_transient_503_is_retried(server, prompts):
    _, url = server
    with front(url, failures=2) as (flaky, seen):
        client = RolloutClient([flaky], api_key=KEY, timeout=60, retries=3, backoff_s=0.01)
        result = client.generate(prompts[:2], 2, max_tokens=8)
    assert len(result.completion_ids) == 4 and all(len(ids) for ids in result.completion_ids)
    assert seen["posts"] == 3  # two 503s, then the answer


def test_replica_fails_over_only_after_its_retries(server, prompts):
    _, url = server
    with front(url, failures=10**6) as (broken, seen):
        client = RolloutClient([broken, url], api_key=KEY, timeout=60, retries=2, backoff_s=0.01)
        result = client.generate(prompts[:4], 2, max_tokens=8)
        assert len(result.completion_ids) == 8 and all(len(ids) for ids in result.completion_ids)
        assert seen["posts"] == 3  # one try and two retries, then its prompts went to the other replica
        with pytest.raises(RolloutServerError, match="503"):
            only_broken = RolloutClient([broken], api_key=KEY, timeout=60, retries=1, backoff_s=0.01)
            only_broken.generate(prompts[:1], 1, max_tokens=4)


def test_stream_fails_over_after_its_retries(server, prompts):
    """The async rollouts' streaming call: a replica answering 503 is retried, then its groups go to the next."""
    _, url = server
    with front(url, failures=10**6) as (broken, seen):
        client = RolloutClient([broken, url], api_key=KEY, timeout=60, retries=2, backoff_s=0.01)
        groups = {}
        client.stream_generate(prompts[:3], 2, lambda i, group: groups.setdefault(i, group), preferred=0, max_tokens=8)
    assert sorted(groups) == [0, 1, 2] and all(len(g.completion_ids) == 2 for g in groups.values())
    assert seen["posts"] == 3


@pytest.mark.parametrize(
    "answer",
    [
        {"choices": "nope"},
        {"id": "x", "model": "m", "usage": {}, "choices": [{"index": 0}]},
        {  # the right count, but both answer sample 0 of prompt 0: sample 1 is missing
            "id": "x",
            "model": "m",
            "usage": {},
            "choices": [
                {
                    "index": 0,
                    "prompt_index": 0,
                    "token_ids": [5],
                    "logprobs": [-1.0],
                    "policy_logprobs": [-1.0],
                    "weight_version": 0,
                    "token_weight_versions": [0],
                },
            ]
            * 2,
        },
    ],
)
def test_answer_breaking_the_protocol_raises_rollout_server_error(answer):
    with front(None, failures=0, answer=answer) as (fake, _):
        client = RolloutClient([fake], timeout=30, retries=0, encoding="json")
        with pytest.raises(RolloutServerError):
            client.generate([[5, 6]], 2, max_tokens=4)


@pytest.mark.parametrize("encoding", ["json", "binary"])
def test_encodings_carry_the_same_completions(server, prompts, encoding):
    """Every encoding's answer has the protocol's shape (the values' equality: test_binary.py), through
    `/v1/completions` and the stream; binary answers carry tensors, the others lists."""
    _, url = server
    client = RolloutClient([url], api_key=KEY, timeout=60, encoding=encoding)
    result = client.generate(prompts[:2], 2, max_tokens=8)
    assert len(result.completion_ids) == 4 and all(len(ids) for ids in result.completion_ids)
    assert all(
        len(ids) == len(lp) == len(v)
        for ids, lp, v in zip(result.completion_ids, result.logprobs, result.token_weight_versions)
    )
    if encoding == "binary":
        assert all(
            lp.dtype == torch.float32 and ids.dtype == torch.int32
            for ids, lp in zip(result.completion_ids, result.logprobs)
        )
    else:
        assert all(isinstance(x, float) for lp in result.logprobs for x in lp)
    streamed = {}
    client.stream_generate(prompts[:3], 2, lambda i, group: streamed.setdefault(i, group), max_tokens=8)
    assert sorted(streamed) == [0, 1, 2] and all(len(g.completion_ids) == 2 for g in streamed.values())


def test_stream_lines_split_across_and_within_pieces():
    from trl_cb.serving.client import _lines

    pieces = [b'{"a"', b": 1}\n{", b'"b": 2}\n\n{"c": 3}\n{"d"', b": 4}"]
    assert list(_lines(iter(pieces))) == [b'{"a": 1}', b'{"b": 2}', b"", b'{"c": 3}', b'{"d": 4}']
