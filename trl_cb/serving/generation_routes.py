"""The rollout server's generation routes: OpenAI's `/v1/completions` (JSON, server-sent events, or trl_cb's binary
answer with `encoding="binary"`), `/v1/chat/completions` (and prime-rl's `/v1/chat/completions/tokens`), vLLM's
`/inference/v1/generate`, OpenAI's `/v1/responses` (`responses_api.py`) and trl_cb's `/v1/completions/stream`.
`server.create_app` includes them.

Invariants: a request is checked before anything is queued (`Generation.submit`: a prompt plus its budget past the
context gets vLLM's wording, a prompt or setting the engine would not apply exactly 400 naming it), then runs as one
`RequestFlow` on the shared engine; every choice carries the values the engine recorded (ids, both logprobs, each
token's weight version; its `weight_version` is its oldest token's); a client gone before its answer gets nothing (its
groups cancelled). No answer is built on the event loop: binary frames and stream lines are packed on the thread pool,
OpenAI answers on `OpenAIServing`'s answer thread.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import APIRouter, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse
from transformers import GenerationConfig

from ..checks.inputs import validate_prompts, validate_token_ids
from ..rollouts.generator import ContinuousBatchingGenerator
from ..rollouts.rollout_groups import RolloutGroup, oldest_version
from .engine_loop import EngineLoop, ServerShuttingDown, Ticket
from .frames import FRAMES_MEDIA_TYPE, frame_pieces
from .info_routes import converted, require_model
from .metrics import RequestCounters
from .openai_protocol import ChatCompletionRequest, OpenAICompletionRequest, context_overflow
from .openai_serving import OpenAIServing
from .prompt_scoring import PromptScores, refuse_unscorable
from .protocol import IGNORE_EOS, Choice, CompletionRequest, PackedColumns, StreamLine, value_runs
from .request_flow import RequestFlow, refusal
from .responses_api import ResponsesRequest, respond
from .vllm_generate import GenerateRequest, generate

__all__ = ["Generation", "encode_choices", "generation_router", "pack_choices"]


@dataclass
class Generation:
    """What every generation route shares: the served model and its name, the engine and the generator whose rules
    it applies, the generation defaults every request starts from, the counters, and the OpenAI answer builder."""

    model: torch.nn.Module
    model_name: str
    generator: ContinuousBatchingGenerator
    engine_loop: EngineLoop
    defaults: dict[str, Any]
    engine_config: dict[str, Any]  # the continuous-batching config the prompts are checked against
    counters: RequestCounters
    tokenizer: Any
    max_model_len: int | None  # prompt + completion budget past it: refused (`context_overflow`)
    openai: OpenAIServing
    eos_ids: set[int]

    def submit(
        self,
        prompts: list[list[int]],
        n: int,
        max_new_tokens: int,
        sampling: dict[str, Any],
        on_done: Callable[[Ticket], None],
        watchers: list[Any] | None = None,
    ) -> list[Ticket]:
        """Check the request (400 naming the reason; past the context, vLLM's wording) and queue its groups."""
        longest = max((len(prompt) for prompt in prompts), default=0)
        if self.max_model_len is not None and longest + max_new_tokens > self.max_model_len:
            self.counters.rejected += 1
            raise context_overflow(self.max_model_len, longest, max_new_tokens)
        try:
            validate_prompts(prompts, self.model, max_new_tokens, self.engine_config)
            sampling = dict(sampling)
            ignore_eos = bool(sampling.pop(IGNORE_EOS, False))
            validate_token_ids("logit_bias", (t for t, _ in sampling.get("logit_bias", ())), self.model)
            config = GenerationConfig(do_sample=True, max_new_tokens=max_new_tokens, **sampling, **self.defaults)
            self.generator.checked_generation_config(config)  # refuses settings the engine cannot apply exactly
        except ValueError as exc:
            self.counters.rejected += 1
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        self.counters.prompt_tokens += sum(len(prompt) for prompt in prompts)
        try:
            return self.engine_loop.submit(
                prompts, n, config, on_done=on_done, watchers=watchers, ignore_eos=ignore_eos
            )
        except ServerShuttingDown as exc:
            raise refusal(exc) from exc

    def flows(self, request: Request) -> Callable[..., RequestFlow]:
        """This request's `RequestFlow` factory (`openai_serving.Flows`); each flow counts as served when it ends."""
        return lambda *args: RequestFlow(self.submit, self.engine_loop, request, *args, on_end=self._served)

    def flow(self, body: CompletionRequest, request: Request) -> RequestFlow:
        """trl_cb's own request's flow (its prompts submitted now)."""
        return self.flows(request)(body.prompt, body.n, body.max_tokens, body.sampling())

    def _served(self) -> None:
        self.counters.served += 1

    def scorer(self, prompts: list[list[int]], top: int = 0) -> Callable[[], Awaitable[tuple[PromptScores, int]]]:
        """`prompt_logprobs`' scoring of `prompts` (awaited once their generation is queued), or 400 naming why the
        served model cannot be scored beside its engine."""
        refused = refuse_unscorable(self.model)
        if refused is not None:
            self.counters.rejected += 1
            raise HTTPException(status_code=400, detail=refused)
        return lambda: run_in_threadpool(self.engine_loop.score, prompts, top)


def generation_router(gen: Generation) -> APIRouter:
    """The routes above on `gen`."""
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(body: OpenAICompletionRequest, request: Request) -> Response:
        """OpenAI's completions (JSON, or server-sent events with `stream`: `openai_serving.py`), or trl_cb's binary
        answer (`encoding="binary"`)."""
        require_model(body.model, gen.model_name)
        prompts = await run_in_threadpool(converted, lambda: body.prompt_ids(gen.tokenizer), gen.counters)
        if body.encoding == "json":
            top = body.scored_positions()
            scored = None if top is None else gen.scorer(prompts, top)
            return await gen.openai.completion(gen.flows(request), body, prompts, scored)
        return await rollout_answer(gen, body.rollout_request(prompts), request)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI's chat completions: messages through the chat template (`tools` too), or `tokens` as the prompt."""
        require_model(body.model, gen.model_name)
        prompt = await run_in_threadpool(converted, lambda: body.prompt_ids(gen.tokenizer), gen.counters)
        return await gen.openai.chat(gen.flows(request), body, prompt)

    router.add_api_route("/v1/chat/completions/tokens", chat_completions, methods=["POST"])  # prime-rl's token-in

    @router.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API (the Agents SDK's default model): one chat completion of the conversation in
        `input`, answered as a `response` object (`responses_api.py`)."""
        require_model(body.model, gen.model_name)
        chat, prompt = await run_in_threadpool(converted, lambda: body.chat_prompt(gen.tokenizer), gen.counters)
        return await respond(gen.openai, gen.flows(request), body, chat, prompt)

    @router.post("/inference/v1/generate")
    async def inference_generate(body: GenerateRequest, request: Request) -> Response:
        """vLLM's token-in, token-out route (`vllm_generate.py`): verifiers' and prime-rl's training clients."""
        require_model(body.model, gen.model_name)
        return await generate(gen.openai, gen.flows(request), body)

    @router.post("/v1/completions/stream")
    async def completions_stream(body: CompletionRequest, request: Request) -> StreamingResponse:
        """One JSON line (binary: one frame) per group (a prompt's `n` choices) as it finishes, in finishing order;
        errors as a line (frame)."""
        return stream_answer(gen, body, request)

    return router


async def rollout_answer(gen: Generation, body: CompletionRequest, request: Request) -> Response:
    """trl_cb's own answer to `/v1/completions` (`encoding="binary"`): every group, then one frame."""
    groups = await gen.flow(body, request).groups()
    if len(groups) < len(body.prompt):  # the client went away: nobody reads this
        raise HTTPException(status_code=499, detail="client disconnected")

    prompt_tokens = sum(len(p) for p in body.prompt)
    generated = sum(len(ids) for group in groups.values() for ids in group.completion_ids)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated}
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "model": gen.model_name}

    async def frame() -> AsyncIterator[bytes]:
        """One frame (`frames.py`): each group's arrays packed in a worker thread, then the frame's pieces, sent as
        they are, so that no step of a large answer (a join, a socket write of the whole body) holds the event loop
        for long."""
        columns = PackedColumns()
        for i in range(len(body.prompt)):
            columns.extend(await run_in_threadpool(pack_choices, groups[i], i, body, gen.eos_ids))
        for piece in await run_in_threadpool(frame_pieces, {**head, "usage": usage}, columns):
            yield piece

    return StreamingResponse(frame(), media_type=FRAMES_MEDIA_TYPE)


def stream_answer(gen: Generation, body: CompletionRequest, request: Request) -> StreamingResponse:
    """`/v1/completions/stream`'s answer: a `StreamLine` (binary: a frame) per group as it ends, encoded in a worker
    thread; a failure after the stream began is its last line (frame)."""
    groups = gen.flow(body, request)

    def encode(i: int, group: RolloutGroup) -> bytes:
        if body.encoding == "binary":  # one frame
            return b"".join(frame_pieces({"prompt_index": i}, pack_choices(group, i, body, gen.eos_ids)))
        choices = b"[" + b",".join(encode_choices(group, i, body, gen.eos_ids)) + b"]"
        return b'{"prompt_index": %d, "choices": ' % i + choices + b"}\n"

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for _, (i, group) in groups:
                yield await run_in_threadpool(encode, i, group)  # a `StreamLine`
        except HTTPException as exc:
            if body.encoding == "binary":
                yield b"".join(frame_pieces({"error": str(exc.detail), "status": exc.status_code}))
                return
            line = StreamLine(error=str(exc.detail), status=exc.status_code)
            yield line.model_dump_json(exclude_none=True, exclude={"choices"}).encode() + b"\n"

    media_type = FRAMES_MEDIA_TYPE if body.encoding == "binary" else "application/x-ndjson"
    return StreamingResponse(lines(), media_type=media_type)


def _choice_fields(prompt_index: int, k: int, n: int, ids: list[int], eos_ids: set[int]) -> dict[str, Any]:
    """Sample k's `index`, `prompt_index` and `finish_reason`."""
    finish_reason = "stop" if ids and ids[-1] in eos_ids else "length"
    return {"index": prompt_index * n + k, "prompt_index": prompt_index, "finish_reason": finish_reason}


def encode_choices(group: RolloutGroup, prompt_index: int, body: CompletionRequest, eos_ids: set[int]) -> list[bytes]:
    """The group's choices as JSON objects, one `Choice` each (`encoding="json"`)."""
    parts = []
    for k, ids in enumerate(group.completion_ids):
        choice = Choice(
            token_ids=ids,
            logprobs=group.logprobs[k],
            policy_logprobs=group.policy_logprobs[k],
            token_weight_versions=group.versions[k],
            weight_version=oldest_version([group.versions[k]], group.submitted_version),
            **_choice_fields(prompt_index, k, body.n, ids, eos_ids),
        )
        parts.append(choice.model_dump_json().encode())
    return parts


def pack_choices(group: RolloutGroup, prompt_index: int, body: CompletionRequest, eos_ids: set[int]) -> PackedColumns:
    """The group's choices packed for a binary frame: each per-token list read once, into bytes."""
    columns = PackedColumns()
    for k, ids in enumerate(group.completion_ids):
        runs = value_runs(group.versions[k])
        oldest = oldest_version([runs[0]], group.submitted_version)  # the run values hold every version
        fields = _choice_fields(prompt_index, k, body.n, ids, eos_ids)
        columns.add(ids, group.logprobs[k], group.policy_logprobs[k], runs, weight_version=oldest, **fields)
    return columns
