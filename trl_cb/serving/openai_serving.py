"""The OpenAI-compatible routes' work: a request's prompts become groups on the shared `EngineLoop`, their samples
are decoded as they arrive (`detokenize.TokenText`), end at a stop string (the engine request is cancelled there),
and are answered as OpenAI objects (`openai_protocol.py`), whole or as server-sent events.

Invariants: every returned or streamed token is a sampled token with the logprobs and version the engine recorded
for it (nothing re-tokenized); a sample keeps every token through the one that completed a stop string, while its
text ends before the stop string (OpenAI; `include_stop_str_in_output` keeps it); a streamed sample's chunks
concatenate to the whole answer's text, ids and values; a stream never sends text that could still turn out to be
the start of a stop string. The routes themselves are `generation_routes.py`'s (auth and limits: `middleware.py`).

Answers are decoded and encoded off the event loop, so it answers `/health` and other requests meanwhile
(docs/benchmarks.md, "Rollout server"): a whole answer and a stream's last chunks on one answer thread
(`OpenAIServing.off_loop`), a stream's samples decoded where their tokens are seen (`_StreamWatcher`, on the engine's
thread); only a stream's per-step chunks, a few hundred bytes each, are encoded on the loop.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import HTTPException
from fastapi.responses import Response, StreamingResponse

from ..rollouts.rollout_groups import PartialSample, RolloutGroup, oldest_version
from .detokenize import StopMatch, TokenBytes, TokenText, find_stop
from .openai_answers import (
    DecodedSample,
    chat_choice,
    chat_chunk,
    chat_delta,
    completion_choice,
    completion_chunk,
    dump,
    response_head,
    usage,
)
from .openai_protocol import ChatCompletionRequest, OpenAICompletionRequest
from .prompt_scoring import PromptScores, prompt_logprob_entries
from .request_flow import RequestFlow

__all__ = [
    "ANSWER_THREADS",
    "EVENT_STREAM",
    "AnswerContext",
    "OpenAIServing",
    "SampleDecoder",
    "all_groups",
    "finished_sample",
]

#: Worker threads that build whole answers. One: the work holds the GIL (pure Python, `json`), so more threads would
#: not answer faster, and every extra runnable thread is one more the event loop waits behind for the GIL (CPython
#: hands it over every `sys.getswitchinterval()`, 5 ms); answers queue for it in arrival order.
ANSWER_THREADS = 1

#: Server-sent events' media type.
EVENT_STREAM = "text/event-stream"

#: A streamed sample's chunks after its first: at most one per this many seconds (each holds the tokens of the steps
#: in between), so the event loop's encoding work follows the clock, not the engine's step rate.
STREAM_INTERVAL_S = 0.02

#: `flows(prompts, n, max_new_tokens, sampling, install)`: the server's `RequestFlow` for this request (submitted at
#: once).
Flows = Callable[..., RequestFlow]

_T = TypeVar("_T")


class SampleDecoder:
    """One sample's text as its tokens arrive; a stop string ends it at the token that completes it."""

    def __init__(
        self,
        tokenizer: Any,
        stops: list[str],
        include_stop: bool,
        skip_special_tokens: bool,
        eos_ids: set[int],
        vocabulary: TokenBytes | None = None,
        stop_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.text = TokenText(tokenizer, skip_special_tokens) if tokenizer is not None else None
        self.stops, self.include_stop, self.eos_ids = stops, include_stop, eos_ids
        self.skip_special_tokens, self.vocabulary, self.stop_ids = skip_special_tokens, vocabulary, stop_ids
        self.ids: list[int] = []
        self.match: StopMatch | None = None
        self.stop_token: int | None = None  # the `stop_token_ids` entry that ended the sample (kept, as vLLM)
        self._searched = 0
        self._hold = max((len(stop) for stop in stops), default=1) - 1

    def feed(self, token_ids: list[int]) -> list[int]:
        """Take the sample's tokens so far; return the new ones it keeps (none after a stop string or stop token)."""
        new = []
        for token in token_ids[len(self.ids) :]:
            if self.ended:
                break
            self.ids.append(token)
            new.append(token)
            if self.text is not None:
                self.text.add(token, silent=token in self.eos_ids)  # the EOS that ends the sample is no text
                if self.stops:
                    self.match = find_stop(self.text.text, self.stops, self._searched)
                    self._searched = len(self.text.text)
            if token in self.stop_ids and self.match is None:
                self.stop_token = token
        return new

    @property
    def ended(self) -> bool:
        """Whether a stop string or a stop token ended the sample (the engine request is cancelled there)."""
        return self.match is not None or self.stop_token is not None

    def visible(self, final: bool) -> str:
        """The text a client may see now: cut at a stop string; while generating, without the tail that could
        still be the start of one."""
        if self.text is None:
            return ""
        if final and self.match is None:
            self.text.finish()
        full = self.text.text
        if self.match is not None:
            return full[: self.match.end if self.include_stop else self.match.start]
        return full if final else full[: max(0, len(full) - self._hold)]

    def pieces(self, start: int, end: int) -> tuple[list[str], list[int], list[bytes]]:
        """Tokens `start:end`: their shares of the text, where each share starts, and each token's own bytes."""
        if self.text is None:
            return [""] * (end - start), [0] * (end - start), [b""] * (end - start)
        pieces = self.text.pieces[start:end]
        if self.vocabulary is None:
            own = [piece.encode("utf-8") for piece in pieces]
        else:
            skip, of = self.skip_special_tokens, self.vocabulary.of
            own = [of(t, p, skip, t in self.eos_ids) for t, p in zip(self.ids[start:end], pieces)]
        return pieces, self.text.offsets[start:end], own


@dataclass
class AnswerContext:
    """What answering one request needs besides its body."""

    tokenizer: Any
    stops: list[str]
    include_stop: bool
    skip_special: bool
    eos_ids: set[int]
    logprobs: bool
    rl: bool
    tools: list[dict[str, Any]] | None = None  # chat: the tools offered (their calls are parsed out of the text)
    vocabulary: TokenBytes | None = None  # each token's own bytes (chat logprobs' `bytes`)
    stop_ids: frozenset[int] = frozenset()  # vLLM's `stop_token_ids`

    def decoder(self) -> SampleDecoder:
        return SampleDecoder(
            self.tokenizer, self.stops, self.include_stop, self.skip_special, self.eos_ids, self.vocabulary,
            self.stop_ids,
        )  # fmt: skip


def finished_sample(ctx: AnswerContext, group: RolloutGroup, k: int, prompt: list[int]) -> DecodedSample:
    """Sample `k` of a finished group, decoded, cut at a stop string, tool calls parsed (chat with tools)."""
    decoder = ctx.decoder()
    kept = decoder.feed(list(group.completion_ids[k]))
    text = decoder.visible(final=True)
    n = len(kept)
    pieces, offsets, own = decoder.pieces(0, n)
    sample = DecodedSample(
        token_ids=kept,
        logprobs=list(group.logprobs[k][:n]),
        policy_logprobs=list(group.policy_logprobs[k][:n]),
        versions=list(group.versions[k][:n]),
        pieces=pieces,
        offsets=offsets,
        token_bytes=own,
        text=text,
        content=text,
        weight_version=oldest_version([group.versions[k][:n]], group.submitted_version),
    )
    if group.top_logprobs is not None and group.top_logprobs[k] is not None:
        sample.alternatives = [_alternatives(ctx, ids, values) for ids, values in group.top_logprobs[k][:n]]
    _finish(ctx, sample, decoder, prompt)
    return sample


def _alternatives(ctx: AnswerContext, ids: list[int], values: list[float]) -> list[tuple[str, float, bytes | None]]:
    """One token's alternatives as (text, logprob, bytes): each token's own text and bytes; without a tokenizer
    (`detokenize: false`), vLLM's `token_id:<id>` and no bytes."""
    if ctx.tokenizer is None:
        return [(f"token_id:{t}", v, None) for t, v in zip(ids, values, strict=True)]
    out = []
    for t, v in zip(ids, values, strict=True):
        text = ctx.tokenizer.decode([t], skip_special_tokens=False)
        own = ctx.vocabulary.of(t, text, False) if ctx.vocabulary is not None else text.encode("utf-8")
        out.append((text, v, own))
    return out


def _finish(ctx: AnswerContext, sample: DecodedSample, decoder: SampleDecoder, prompt: list[int]) -> None:
    """finish_reason / stop_reason, and for chat with tools the parsed message."""
    if decoder.match is not None:
        sample.finish_reason, sample.stop_reason = "stop", decoder.match.stop
    elif decoder.stop_token is not None:
        sample.finish_reason, sample.stop_reason = "stop", decoder.stop_token  # vLLM: the id that stopped it
    else:
        ended = bool(decoder.ids) and decoder.ids[-1] in ctx.eos_ids
        sample.finish_reason = "stop" if ended else "length"
    if ctx.tools and ctx.tokenizer is not None and decoder.ids:
        message = _parsed(ctx.tokenizer, decoder.ids, prompt, ctx.tools)
        if message.get("tool_calls"):
            sample.tool_calls = message["tool_calls"]
            sample.content = message.get("content") or None
            sample.finish_reason = "tool_calls"


def _parsed(tokenizer: Any, ids: list[int], prompt: list[int], tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message in `ids` as TRL parses it for training (`trl.chat_template_utils.parse_response`), tool
    calls in OpenAI's shape; a tokenizer without a response template parses nothing."""
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        return {}
    from trl.chat_template_utils import parse_response

    message = parse_response(tokenizer, ids, prefix=prompt, tools=tools)
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {})
        arguments = function.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": function.get("name", ""),
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
    return {"content": message.get("content"), "tool_calls": calls}


@dataclass(frozen=True)
class _ChunkFormat:
    """How a stream's chunks look: the answer's head (id, model, object), the samples per prompt, chat or not."""

    head: dict[str, Any]
    n: int
    chat: bool


class _StreamWatcher:
    """The engine-side half of a stream (or of a stop-string search): decodes each sample of one prompt step by step,
    ends a sample at its stop string, and when streaming (`fmt`) posts each sample's new piece,
    `("delta", (prompt index, sample index, piece))`, which `event` encodes; `tail_events` encodes the last chunks
    once the prompt's group ended. A sample's first tokens are posted at once, later ones at most every
    `STREAM_INTERVAL_S` (a chunk then holds the tokens of several steps, as vLLM's `stream_interval`): the event loop
    encodes one event per sample per interval, not per engine step, whatever the step rate (docs/benchmarks.md)."""

    def __init__(self, ctx: AnswerContext, prompt_index: int, prompt: list[int], fmt: _ChunkFormat | None) -> None:
        self.ctx, self.prompt_index, self.prompt, self.fmt = ctx, prompt_index, prompt, fmt
        self.post: Callable[[Any], None] | None = None  # set by the request flow before the engine starts
        self.decoders: dict[int, SampleDecoder] = {}
        self.sent: dict[int, int] = {}  # per sample: characters of its visible text already sent
        self.started: set[tuple[int, int]] = set()  # samples whose first chunk (with the prompt's ids) went out
        self.unsent: dict[int, int] = {}  # per sample: its first token not yet in a posted chunk
        self.values: dict[int, tuple[list, list, list]] = {}  # per sample: its logprobs, policy logprobs, versions
        self.posted_at: dict[int, float] = {}  # per sample: when its last chunk was posted (monotonic s)

    def __call__(self, partial: PartialSample) -> bool:
        k = partial.index
        decoder = self._decoder(k)
        start = len(decoder.ids)
        new = decoder.feed(partial.token_ids)
        if self.fmt is None or self.post is None:  # a stop search only: nothing to post
            return decoder.ended
        self.unsent.setdefault(k, start)
        self.values[k] = (partial.logprobs, partial.policy_logprobs, partial.versions)
        now = time.monotonic()
        if new and not decoder.ended and now - self.posted_at.get(k, -math.inf) >= STREAM_INTERVAL_S:
            self.post(("delta", (self.prompt_index, k, self._delta(k, self.unsent.pop(k), self.values[k]))))
            self.posted_at[k] = now
        return decoder.ended

    def tail_events(self) -> tuple[list[bytes], int]:
        """Each sample's last chunk, encoded, and the tokens they carry (call once the prompt's group ended, off the
        event loop)."""
        samples = [(k, self.tail(k)) for k in range(self._format().n)]
        return [self.event(k, sample) for k, sample in samples], sum(len(s.token_ids) for _, s in samples)

    def event(self, k: int, sample: DecodedSample) -> bytes:
        """Sample k's chunk holding `sample` (a step's new piece, or the last one), as a server-sent event."""
        fmt = self._format()
        return _event(
            _chunk(self.ctx, fmt.head, fmt.n, self.prompt_index, k, sample, self.prompt, self.started, fmt.chat)
        )

    def _format(self) -> _ChunkFormat:
        if self.fmt is None:
            raise RuntimeError("this watcher does not stream")
        return self.fmt

    def tail(self, k: int) -> DecodedSample:
        """Sample k's last chunk once its group ended: its held-back text, finish reason and (chat with tools) the
        parsed message."""
        decoder = self._decoder(k)
        sample = self._delta(k, self.unsent.get(k, len(decoder.ids)), self.values.get(k, ([], [], [])), final=True)
        _finish(self.ctx, sample, decoder, self.prompt)
        if self.ctx.tools and not sample.tool_calls:  # the text was held back for parsing: all of it now
            sample.content = decoder.visible(final=True) or None
        return sample

    def _decoder(self, k: int) -> SampleDecoder:
        if k not in self.decoders:
            self.decoders[k] = self.ctx.decoder()
        return self.decoders[k]

    def _delta(self, k: int, start: int, values: tuple[list, list, list], final: bool = False) -> DecodedSample:
        decoder = self.decoders[k]
        end = len(decoder.ids)
        pieces, offsets, own = decoder.pieces(start, end)
        visible = decoder.visible(final)
        text, self.sent[k] = visible[self.sent.get(k, 0) :], len(visible)
        logprobs, policy, versions = (list(v[start:end]) for v in values)
        return DecodedSample(
            token_ids=decoder.ids[start:end],
            logprobs=logprobs,
            policy_logprobs=policy,
            versions=versions,
            pieces=pieces,
            offsets=offsets,
            token_bytes=own,
            text=text,
            content=None if self.ctx.tools else text,  # with tools, the message is parsed at the end
            weight_version=min(values[2][:end], default=None),
        )


class OpenAIServing:
    """Answers `/v1/completions` (JSON) and `/v1/chat/completions` on the server's request flows."""

    def __init__(self, tokenizer: Any, model_name: str, eos_ids: set[int]) -> None:
        self.tokenizer, self.model_name, self.eos_ids = tokenizer, model_name, eos_ids
        self.vocabulary = TokenBytes(tokenizer) if tokenizer is not None else None
        self._answers = ThreadPoolExecutor(max_workers=ANSWER_THREADS, thread_name_prefix="trl-cb-answers")

    async def off_loop(self, build: Callable[..., _T], *args: Any) -> _T:
        """`build(*args)` on the answer thread (`ANSWER_THREADS`), awaited: decoding and JSON of a whole answer can
        take seconds of CPU, which on the event loop would hold every other request and `/health` for as long
        (docs/benchmarks.md). The work holds the GIL in short pieces only (`openai_answers.dump`)."""
        return await asyncio.get_running_loop().run_in_executor(self._answers, functools.partial(build, *args))

    def context(self, body: Any, logprobs: bool, tools: list[dict[str, Any]] | None = None) -> AnswerContext:
        """What answering `body` needs (its stop strings and stop token ids, its RL switch, the tokenizer: none with
        `detokenize: false`, whose answers carry no text, so nothing is decoded for clients that read ids only)."""
        rl = bool(body.return_token_ids)
        stops, skip = body.stops(), body.skip_special_tokens
        decode = getattr(body, "detokenize", True)
        tokenizer, vocabulary = (self.tokenizer, self.vocabulary) if decode else (None, None)
        return AnswerContext(
            tokenizer, stops, body.include_stop_str_in_output, skip, self.eos_ids, logprobs, rl, tools,
            vocabulary, frozenset(body.stop_token_ids or ()),
        )  # fmt: skip

    def streamed_flow(self, flows: Flows, body: Any, ctx: AnswerContext, prompt: list[int]) -> RequestFlow:
        """One prompt's flow whose watcher posts each sample's new tokens, decoded, as `("delta", (0, k, sample))`
        (a `DecodedSample` of those tokens), at most one per `STREAM_INTERVAL_S` (for other routes' event streams)."""
        flow, _ = self.flow(flows, body, ctx, [prompt], _ChunkFormat({}, body.n, chat=True))
        return flow

    def flow(
        self, flows: Flows, body: Any, ctx: AnswerContext, prompts: list[list[int]], fmt: _ChunkFormat | None = None
    ) -> tuple[RequestFlow, list[_StreamWatcher]]:
        """The request's flow (submitted now: a bad prompt raises here, before any answer), with a watcher per prompt
        where the answer streams (`fmt`: its chunks) or has stop strings or stop token ids to find."""
        watched = fmt is not None or bool(ctx.stops and ctx.tokenizer is not None) or bool(ctx.stop_ids)
        watchers = [_StreamWatcher(ctx, i, prompt, fmt) for i, prompt in enumerate(prompts)] if watched else []

        def install(post: Callable[[Any], None]) -> list:
            for watcher in watchers:
                watcher.post = post
            return watchers or [None] * len(prompts)

        return flows(prompts, body.n, body.max_new_tokens(), body.sampling(), install), watchers

    async def completion(
        self,
        flows: Flows,
        body: OpenAICompletionRequest,
        prompts: list[list[int]],
        scored: Callable[[], Awaitable[tuple[PromptScores, int]]] | None = None,
    ) -> Response:
        """One JSON object, or server-sent events with `stream`; with `scored` (`prompt_logprobs`), each choice also
        carries its prompt's token logprobs, scored while the samples generate."""
        ctx = self.context(body, logprobs=body.logprobs is not None)
        head = response_head("text_completion", self.model_name)
        fmt = _ChunkFormat(head, body.n, chat=False) if body.stream else None
        flow, watchers = self.flow(flows, body, ctx, prompts, fmt)
        if fmt is not None:
            return StreamingResponse(self._stream(body, fmt, prompts, flow, watchers), media_type=EVENT_STREAM)
        try:
            scores = None if scored is None else await scored()
        except BaseException:
            flow.cancel()  # nobody will read the samples
            raise
        groups = await all_groups(flow, len(prompts))
        shown = (scores, body.prompt_logprobs is not None, bool(body.echo))
        answer = await self.off_loop(completion_answer, ctx, head, body.n, prompts, groups, *shown)
        return Response(answer, media_type="application/json")

    async def chat(self, flows: Flows, body: ChatCompletionRequest, prompt: list[int]) -> Response:
        ctx = self.context(body, logprobs=bool(body.logprobs), tools=body.offered_tools())
        head = response_head("chat.completion", self.model_name)
        fmt = _ChunkFormat({**head, "object": "chat.completion.chunk"}, body.n, chat=True) if body.stream else None
        flow, watchers = self.flow(flows, body, ctx, [prompt], fmt)
        if fmt is not None:
            return StreamingResponse(self._stream(body, fmt, [prompt], flow, watchers), media_type=EVENT_STREAM)
        groups = await all_groups(flow, 1)
        answer = await self.off_loop(chat_answer, ctx, head, body.n, prompt, groups[0])
        return Response(answer, media_type="application/json")

    async def _stream(
        self, body: Any, fmt: _ChunkFormat, prompts: list[list[int]], flow: RequestFlow, watchers: list[_StreamWatcher]
    ) -> AsyncIterator[bytes]:
        """Server-sent events: a chunk per sample per `STREAM_INTERVAL_S` at most (a small event, encoded here:
        measured, encoding it on the engine's thread instead doubled `/health`'s p99, docs/benchmarks.md), a last chunk
        per sample (the rest of its tokens and text, its finish reason; the group's, on the answer thread), the usage
        if asked, then `[DONE]`."""
        generated = 0
        try:
            async for kind, payload in flow:
                if kind == "delta":
                    i, k, sample = payload
                    generated += len(sample.token_ids)
                    yield watchers[i].event(k, sample)
                    continue
                events, tokens = await self.off_loop(watchers[payload[0]].tail_events)
                generated += tokens
                for event in events:
                    yield event
        except Exception as exc:  # the request failed after the stream began: said in the stream
            status = getattr(exc, "status_code", 500)
            yield _event({"error": {"message": str(getattr(exc, "detail", exc))[:500], "code": status}})
        else:
            if body.include_usage():
                yield _event({**fmt.head, "choices": [], "usage": usage(sum(map(len, prompts)), generated)})
        yield b"data: [DONE]\n\n"


def completion_answer(
    ctx: AnswerContext,
    head: dict[str, Any],
    n: int,
    prompts: list[list[int]],
    groups: dict[int, RolloutGroup],
    scores: tuple[PromptScores, int] | None = None,
    prompt_logprobs: bool = True,
    echo: bool = False,
) -> bytes:
    """The whole completion answer's JSON: every sample of every prompt decoded (`finished_sample`), encoded; with
    `prompt_logprobs`, each choice carries its prompt's `prompt_logprobs` from `scores` (with `return_token_ids`,
    their weight version); with `echo`, each choice's text (and logprobs) starts with its prompt's (`echoed`)."""
    samples = [(i, k, finished_sample(ctx, groups[i], k, prompts[i])) for i in sorted(groups) for k in range(n)]
    choices = [completion_choice(i * n + k, s, ctx.logprobs, ctx.rl, prompts[i]) for i, k, s in samples]
    if echo:
        for (i, _, _), choice in zip(samples, choices, strict=True):
            echoed(ctx, choice, prompts[i], scores[0][i][0] if scores is not None else None)
    if scores is not None and prompt_logprobs:
        values, version = scores
        entries = {i: prompt_logprob_entries(prompts[i], values[i], ctx.tokenizer) for i in sorted(groups)}
        for (i, _, _), choice in zip(samples, choices, strict=True):
            choice["prompt_logprobs"] = entries[i]
            if ctx.rl:
                choice["prompt_logprobs_weight_version"] = version
    generated = sum(len(s.token_ids) for _, _, s in samples)
    return dump({**head, "choices": choices, "usage": usage(sum(map(len, prompts)), generated)})


def echoed(ctx: AnswerContext, choice: dict[str, Any], prompt: list[int], values: list[float] | None) -> None:
    """OpenAI's `echo` on a completion choice: the prompt's text before the sample's; with logprobs, the prompt's
    tokens before the sample's (`None` for the first, then each token's logprob under the served policy, `values`:
    the prompt's scoring, `prompt_scoring.py`), their offsets in the echoed text."""
    decoder = SampleDecoder(ctx.tokenizer, [], False, ctx.skip_special, set(), ctx.vocabulary)
    decoder.feed(prompt)
    text = decoder.visible(final=True)
    choice["text"] = text + choice["text"]
    logprobs = choice["logprobs"]
    if logprobs is None or values is None:
        return
    pieces, offsets, _ = decoder.pieces(0, len(prompt))
    given = [None, *values]
    logprobs["tokens"] = pieces + logprobs["tokens"]
    logprobs["token_logprobs"] = given + logprobs["token_logprobs"]
    top = [None if lp is None else {piece: lp} for piece, lp in zip(pieces, given, strict=True)]
    logprobs["top_logprobs"] = top + logprobs["top_logprobs"]
    logprobs["text_offset"] = offsets + [len(text) + offset for offset in logprobs["text_offset"]]


def chat_answer(ctx: AnswerContext, head: dict[str, Any], n: int, prompt: list[int], group: RolloutGroup) -> bytes:
    """The whole chat answer's JSON: the prompt's `n` samples decoded (tool calls parsed), encoded."""
    samples = [finished_sample(ctx, group, k, prompt) for k in range(n)]
    answer = {**head, "choices": [chat_choice(k, s, ctx.logprobs, ctx.rl) for k, s in enumerate(samples)]}
    answer["usage"] = usage(len(prompt), sum(len(s.token_ids) for s in samples))
    if ctx.rl:
        answer["prompt_token_ids"] = prompt
    return dump(answer)


def _chunk(
    ctx: AnswerContext,
    head: dict[str, Any],
    n: int,
    i: int,
    k: int,
    sample: DecodedSample,
    prompt: list[int],
    started: set[tuple[int, int]],
    chat: bool,
) -> dict[str, Any]:
    """One stream chunk for sample k of prompt i; the first of each sample carries the prompt's ids (RL fields)."""
    first = (i, k) not in started
    started.add((i, k))
    if chat:
        chunk = chat_chunk(head, [chat_delta(k, sample, ctx.logprobs, ctx.rl, first)])
        if ctx.rl and first:
            chunk["prompt_token_ids"] = prompt
        return chunk
    choice = completion_choice(i * n + k, sample, ctx.logprobs, ctx.rl, prompt if first else None)
    return completion_chunk(head, [choice])


async def all_groups(flow: RequestFlow, count: int) -> dict[int, RolloutGroup]:
    """Every group of `flow` by prompt index (499 if the client left before the last)."""
    groups = await flow.groups()
    if len(groups) < count:  # the client went away: nobody reads this
        raise HTTPException(status_code=499, detail="client disconnected")
    return groups


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + dump(body) + b"\n\n"
