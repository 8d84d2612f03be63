"""OpenAI answers are decoded and encoded off the server's event loop: a whole answer and a stream's last chunks on the
answer thread (`OpenAIServing.off_loop`). While one answer's decoder or encoder is held on an event, `/health` still
answers; released, the answer completes. Control: with the answer built on the loop again (the code before), `/health`
gets no answer while the gate is held.

No clock is raced against the work: the test waits until the request reached the gate, asks `/health`, and only then
opens the gate. A fake engine finishes every group at once (the answer's work is all there is).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests

from tests.unit.serving.conftest import in_process_server
from trl_cb.offline.tiny import tiny_model
from trl_cb.rollouts.rollout_groups import PartialSample, RolloutGroup
from trl_cb.serving import openai_serving, vllm_generate
from trl_cb.serving.engine_loop import Ticket
from trl_cb.serving.openai_serving import OpenAIServing, SampleDecoder
from trl_cb.serving.server import create_app

N, TOKENS = 2, 12
PROMPT = [5, 6, 7]
#: (route, body) of each route whose whole answer is built on the answer thread.
ROUTES = {
    "completions": ("/v1/completions", {"prompt": [PROMPT, PROMPT], "n": N, "max_tokens": TOKENS, "logprobs": 0}),
    "chat": ("/v1/chat/completions", {"tokens": PROMPT, "n": N, "max_tokens": TOKENS, "logprobs": True}),
    "generate": ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"n": N, "max_tokens": TOKENS}}),
}


class Gate:
    """Wraps a function so that its first call announces itself (`entered`) and waits for `opened`."""

    def __init__(self) -> None:
        self.entered, self.opened = threading.Event(), threading.Event()

    def wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def gated(*args: Any, **kwargs: Any) -> Any:
            self.entered.set()
            self.opened.wait(timeout=300)  # opened by the test (its `finally` too): never a race against a clock
            return function(*args, **kwargs)

        return gated


@pytest.fixture
def url(tokenizer) -> Iterator[str]:
    """A server with the tiny tokenizer whose engine answers every group at once with fixed samples."""
    app = create_app(tiny_model(tokenizer), tokenizer=tokenizer)
    ids = [(9 + 7 * t) % 400 + 20 for t in range(TOKENS)]

    def submit(prompts, n, config, on_done=None, watchers=None, ignore_eos=False):
        tickets = [Ticket(list(p), n, config, on_done=on_done) for p in prompts]
        for ticket in tickets:
            group = RolloutGroup(row=None, prompt_ids=ticket.prompt_ids, submitted_version=0)
            group.completion_ids = [list(ids) for _ in range(n)]
            group.logprobs = group.policy_logprobs = [[-0.5] * TOKENS for _ in range(n)]
            group.versions = [[0] * TOKENS for _ in range(n)]
            ticket.finish(group)
        return tickets

    app.state.engine_loop.submit = submit
    with in_process_server(app) as served:
        yield served


@pytest.fixture
def streaming_url(tokenizer) -> Iterator[str]:
    """A server whose fake engine runs each request on a thread of its own, as the engine's: every sample's tokens
    shown to its watcher in two steps, then the groups finished."""
    app = create_app(tiny_model(tokenizer), tokenizer=tokenizer)
    ids = [(9 + 7 * t) % 400 + 20 for t in range(TOKENS)]

    def submit(prompts, n, config, on_done=None, watchers=None, ignore_eos=False):
        tickets = [Ticket(list(p), n, config, on_done=on_done) for p in prompts]

        def engine() -> None:
            for ticket, watcher in zip(tickets, watchers or [None] * len(tickets), strict=True):
                for end in (TOKENS // 2, TOKENS):
                    for k in range(n):
                        if watcher is not None:
                            watcher(PartialSample(k, ids[:end], [-0.5] * end, [-0.5] * end, [0] * end))
                group = RolloutGroup(row=None, prompt_ids=ticket.prompt_ids, submitted_version=0)
                group.completion_ids = [list(ids) for _ in range(n)]
                group.logprobs = group.policy_logprobs = [[-0.5] * TOKENS for _ in range(n)]
                group.versions = [[0] * TOKENS for _ in range(n)]
                ticket.finish(group)

        threading.Thread(target=engine, daemon=True).start()
        return tickets

    app.state.engine_loop.submit = submit
    with in_process_server(app) as served:
        yield served


def streamed_request(url: str, gate: Gate, health_timeout: float) -> tuple[list[dict], bool]:
    """A streamed chat request's chunks, and whether `/health` answered while its chunk encoding was held."""
    body = {"tokens": PROMPT, "n": N, "max_tokens": TOKENS, "logprobs": True, "stream": True}
    chunks: list[dict] = []

    def read() -> None:
        with requests.post(url + "/v1/chat/completions", json=body, timeout=300, stream=True) as response:
            for line in response.iter_lines():
                if line.startswith(b"data: {"):
                    chunks.append(json.loads(line[len(b"data: ") :]))

    return chunks, health_while_held(url, gate, read, health_timeout)


def test_health_answers_while_a_streams_last_chunks_are_encoded(streaming_url, monkeypatch):
    """The chunk encoder held at a last chunk (on the answer thread, once the group ended): `/health` answers;
    released, every token arrives."""
    gate, encode = Gate(), openai_serving._event

    def encoder(body: dict) -> bytes:
        last = any(choice.get("finish_reason") for choice in body.get("choices", []))
        return gate.wrap(encode)(body) if last else encode(body)

    monkeypatch.setattr(openai_serving, "_event", encoder)
    chunks, healthy = streamed_request(streaming_url, gate, health_timeout=60)
    assert healthy
    per_sample: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            per_sample.setdefault(choice["index"], []).extend(
                choice["logprobs"]["content"] if choice["logprobs"] else []
            )
    assert sorted(per_sample) == list(range(N)) and all(len(v) == TOKENS for v in per_sample.values())


def test_control_a_stream_encoded_on_the_loop_holds_health(streaming_url, monkeypatch):
    """Control: the last chunks built on the event loop (`off_loop` inline, as the code before built them there):
    `/health` gets no answer while the encoder is held."""

    async def inline(self, build, *args):
        return build(*args)

    gate, encode = Gate(), openai_serving._event

    def encoder(body: dict) -> bytes:
        last = any(choice.get("finish_reason") for choice in body.get("choices", []))
        return gate.wrap(encode)(body) if last else encode(body)

    monkeypatch.setattr(OpenAIServing, "off_loop", inline)
    monkeypatch.setattr(openai_serving, "_event", encoder)
    chunks, healthy = streamed_request(streaming_url, gate, health_timeout=1.0)
    assert not healthy and chunks


def gated(monkeypatch: pytest.MonkeyPatch, step: str) -> Gate:
    """`step`'s function held on a new gate: the detokenizer (every route) or the JSON encoder."""
    gate = Gate()
    if step == "decode":
        monkeypatch.setattr(SampleDecoder, "feed", gate.wrap(SampleDecoder.feed))
    else:
        monkeypatch.setattr(openai_serving, "dump", gate.wrap(openai_serving.dump))
        monkeypatch.setattr(vllm_generate, "dump", gate.wrap(vllm_generate.dump))
    return gate


def held_request(url: str, route: str, gate: Gate, health_timeout: float) -> tuple[requests.Response, bool]:
    """`route`'s request, and whether `/health` answered while the request was held at `gate`."""
    path, body = ROUTES[route]
    answer: dict[str, requests.Response] = {}
    send = lambda: answer.update(r=requests.post(url + path, json=body, timeout=300))  # noqa: E731
    healthy = health_while_held(url, gate, send, health_timeout)
    return answer["r"], healthy


def health_while_held(url: str, gate: Gate, send: Callable[[], None], health_timeout: float) -> bool:
    """Run `send` (a request) on a thread; once it reached `gate`, whether `/health` answers; then open the gate and
    wait for the request to end."""
    request = threading.Thread(target=send)
    request.start()
    try:
        assert gate.entered.wait(timeout=300), "the request never reached the gated step"
        try:
            healthy = requests.get(url + "/health", timeout=health_timeout).status_code == 200
        except requests.Timeout:
            healthy = False
        assert not gate.opened.is_set() and request.is_alive()  # the answer was held the whole time
    finally:
        gate.opened.set()
        request.join(timeout=300)
    return healthy


@pytest.mark.parametrize("step", ["decode", "encode"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_health_answers_while_an_answer_is_built(url, monkeypatch, route, step):
    answer, healthy = held_request(url, route, gated(monkeypatch, step), health_timeout=60)
    assert healthy
    assert answer.status_code == 200
    choices = answer.json()["choices"]
    assert len(choices) == (2 * N if route == "completions" else N)
    assert [len(tokens_of(route, choice)) for choice in choices] == [TOKENS] * len(choices)


def tokens_of(route: str, choice: dict[str, Any]) -> list[Any]:
    """A choice's per-token entries in `route`'s answer shape."""
    if route == "generate":
        return choice["token_ids"]
    return choice["logprobs"]["content"] if route == "chat" else choice["logprobs"]["token_logprobs"]


def test_control_an_answer_built_on_the_loop_holds_health(url, monkeypatch):
    """The same gate with `off_loop` running the build inline on the event loop: `/health` cannot answer while the
    gate is held (the loop itself waits on it), whatever the timeout; the answer completes once it opens."""

    async def inline(self, build, *args):
        return build(*args)

    monkeypatch.setattr(OpenAIServing, "off_loop", inline)
    answer, healthy = held_request(url, "completions", gated(monkeypatch, "encode"), health_timeout=1.0)
    assert not healthy
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 2 * N


def test_a_streamed_sample_is_posted_at_most_once_per_interval(tokenizer, monkeypatch):
    """The first tokens go out at once; the steps inside one `STREAM_INTERVAL_S` are held and go out together in the
    next chunk (or the last one): every token once, in order, with its own logprob. Control: with no interval, a chunk
    per step."""
    clock = [100.0]
    monkeypatch.setattr(openai_serving.time, "monotonic", lambda: clock[0])
    ctx = openai_serving.AnswerContext(tokenizer, [], False, True, set(), True, False)
    fmt = openai_serving._ChunkFormat({"id": "x", "object": "chat.completion.chunk"}, 1, chat=True)  # noqa: SLF001
    tokens = tokenizer("one two three four five six")["input_ids"]
    lps = [-0.1 * (i + 1) for i in range(len(tokens))]

    def chunks(interval: float) -> list[list[int]]:
        monkeypatch.setattr(openai_serving, "STREAM_INTERVAL_S", interval)
        watcher = openai_serving._StreamWatcher(ctx, 0, [1, 2], fmt)  # noqa: SLF001
        posted: list[Any] = []
        watcher.post = posted.append
        for step in range(1, len(tokens) + 1):
            clock[0] += 0.008  # an engine step every 8 ms
            watcher(PartialSample(0, tokens[:step], lps[:step], lps[:step], [0] * step))
        pieces = [payload[2] for _, payload in posted] + [watcher.tail(0)]
        assert [t for p in pieces for t in p.token_ids] == tokens  # every token once, in order
        assert [v for p in pieces for v in p.logprobs] == lps
        return [p.token_ids for p in pieces if p.token_ids]

    held = chunks(0.02)
    assert len(held[0]) == 1 and max(map(len, held)) == 3  # the first at once, then 3 steps (24 ms) per chunk
    assert len(held) < len(tokens)
    assert [len(c) for c in chunks(0.0)] == [1] * len(tokens)  # control: no interval, a chunk per step
