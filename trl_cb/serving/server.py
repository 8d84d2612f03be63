"""The rollout server's HTTP app: one persistent `ServingEngine` behind FastAPI (docs/server.md). `create_app` holds
the generation routes and includes the others (`info_routes.py`, `weight_routes.py`); `serve` runs it.

Invariants: concurrent requests share the engine's batch (`engine.py`); weights change between two engine steps, and
every token reports the `weight_version` that sampled it (`token_weight_versions`; a choice's `weight_version` is its
oldest token's). A client that disconnects cancels its groups. Bad requests get 4xx naming the reason and leave the
server serving; a 4xx never echoes the request's values. `middleware.RequestGate` fronts the whole app: with an API
key every path but `/health` (FastAPI's own docs routes too) requires `Authorization: Bearer KEY`, refused with 401 on
the headers before any body is read, and bodies over `max_body_bytes` get 413 while being read. Weight updates, waits
and close also require the init token (else 403); versions strictly increase per owner (else 409), and non-finite
weights are refused (400 from `/weights/wait`) with the served weights unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch
from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import GenerationConfig

from ..checks.inputs import validate_prompts
from ..rollouts.generator import ContinuousBatchingGenerator
from ..rollouts.rollout_groups import RolloutGroup, oldest_version
from .engine import ServerShuttingDown, ServingEngine, Ticket
from .frames import FRAMES_MEDIA_TYPE, frame_pieces
from .info_routes import converted, info_router, require_model
from .metrics import RequestCounters
from .middleware import RequestGate
from .openai_protocol import (
    ChatCompletionRequest,
    OpenAICompletionRequest,
    OpenAIError,
    context_overflow,
)
from .openai_serving import OpenAIServing
from .protocol import (
    DEFAULT_MAX_BODY_BYTES,
    Choice,
    CompletionRequest,
    PackedColumns,
    StreamLine,
    value_runs,
)
from .request_flow import RequestFlow, refusal
from .vllm_generate import GenerateRequest, generate
from .weight_receiver import WeightReceiver
from .weight_routes import weight_router

logger = logging.getLogger(__name__)


def create_app(
    model: torch.nn.Module,
    model_name: str = "model",
    generation_defaults: dict[str, Any] | None = None,
    api_key: str | None = None,
    continuous_batching_config: dict[str, Any] | None = None,
    max_num_seqs: int = 256,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    tokenizer: Any = None,
    prefix_caching: bool = True,
) -> FastAPI:
    """An app serving `model` (a transformers causal LM) with trl_cb's engine.

    `generation_defaults`: `GenerationConfig` fields every request starts from (e.g. `eos_token_id`,
    `pad_token_id`); request fields (`max_tokens`, `temperature`, `top_p`, `top_k`) override them.
    `max_num_seqs`: most sequences generating at once (the engine's cache is sized for them); more requests queue.
    `max_body_bytes`: the largest request body read (413 past it).
    `tokenizer`: the served model's (text prompts, chat, answers' text: the OpenAI-compatible routes); without one,
    only token-id prompts are served and answers carry no text.
    `prefix_caching`: a request reuses the KV blocks of earlier requests' shared prefix (a conversation's earlier
    turns), never across a weight update (`ServingEngine`).
    """
    defaults = {"eos_token_id": model.generation_config.eos_token_id, "pad_token_id": model.config.pad_token_id}
    defaults.update(generation_defaults or {})
    model.eval()
    # Requests with different temperature / top_k / top_p share the running engine (engine.py), unless turned off.
    continuous_batching_config = {"per_request_processors": True, **(continuous_batching_config or {})}
    generator = ContinuousBatchingGenerator(
        model, GenerationConfig(do_sample=True, max_new_tokens=16, **defaults), continuous_batching_config
    )
    per_request = bool(continuous_batching_config["per_request_processors"])
    engine = ServingEngine(generator, model, max_num_seqs, per_request=per_request, share_prefixes=prefix_caching)
    weights = WeightReceiver(model, engine.apply_weights)
    counters = RequestCounters()

    eos = defaults.get("eos_token_id")
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    app = FastAPI(title="trl_cb rollout server")
    app.add_middleware(RequestGate, api_key=api_key, max_body_bytes=max_body_bytes)  # auth and size, on headers
    app.state.engine = engine
    #: The context: prompt + completion budget past it is refused with vLLM's wording (`context_overflow`).
    max_model_len = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    openai = OpenAIServing(with_response_parser(tokenizer), model_name, eos_ids)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        """422 naming each field and rule, without the input (FastAPI's default echoes it: megabytes for a long
        prompt, and a 500 for NaN, which JSON cannot encode)."""
        counters.rejected += 1
        errors = [
            {"loc": [str(part) for part in error.get("loc", ())][:6], "msg": str(error.get("msg", ""))[:300]}
            for error in exc.errors()[:10]
        ]
        return JSONResponse(status_code=422, content={"detail": errors})

    @app.exception_handler(OpenAIError)
    async def openai_refusal(request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content=exc.body)

    app.include_router(info_router(model, model_name, engine, weights, counters, max_model_len, tokenizer))

    def submit(
        prompts: list[list[int]],
        n: int,
        max_tokens: int,
        sampling: dict[str, Any],
        on_done: Callable[[Ticket], None],
        watchers: list[Any] | None = None,
    ) -> list[Ticket]:
        """Check the request (400 naming the reason; past the context, vLLM's wording) and queue its groups."""
        longest = max((len(prompt) for prompt in prompts), default=0)
        if max_model_len is not None and longest + max_tokens > max_model_len:
            counters.rejected += 1
            raise context_overflow(max_model_len, longest, max_tokens)
        try:
            validate_prompts(prompts, model, max_tokens, continuous_batching_config)
            config = GenerationConfig(do_sample=True, max_new_tokens=max_tokens, **sampling, **defaults)
            generator.checked_generation_config(config)  # refuses settings the engine cannot apply exactly
        except ValueError as exc:
            counters.rejected += 1
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        counters.prompt_tokens += sum(len(prompt) for prompt in prompts)
        try:
            return engine.submit(prompts, n, config, on_done=on_done, watchers=watchers)
        except ServerShuttingDown as exc:
            raise refusal(exc) from exc

    def served() -> None:
        counters.served += 1

    def flows(request: Request) -> Callable[..., RequestFlow]:
        """This request's `RequestFlow` factory (`openai_serving.Flows`)."""
        return lambda *args: RequestFlow(submit, engine, request, *args, on_end=served)

    def flow(body: CompletionRequest, request: Request) -> RequestFlow:
        sampling = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}
        return flows(request)(body.prompt, body.n, body.max_tokens, sampling)

    @app.post("/v1/completions")
    async def completions(body: OpenAICompletionRequest, request: Request) -> Response:
        """OpenAI's completions (JSON, or server-sent events with `stream`: `openai_serving.py`), or trl_cb's binary
        answer (`encoding="binary"`)."""
        require_model(body.model, model_name)
        prompts = await run_in_threadpool(converted, lambda: body.prompt_ids(tokenizer), counters)
        if body.encoding == "json":
            return await openai.completion(flows(request), body, prompts)
        return await rollout_answer(body.rollout_request(prompts), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI's chat completions: messages through the chat template (`tools` too), or `tokens` as the prompt."""
        require_model(body.model, model_name)
        prompt = await run_in_threadpool(converted, lambda: body.prompt_ids(tokenizer), counters)
        return await openai.chat(flows(request), body, prompt)

    app.add_api_route("/v1/chat/completions/tokens", chat_completions, methods=["POST"])  # prime-rl's token-in path

    @app.post("/inference/v1/generate")
    async def inference_generate(body: GenerateRequest, request: Request) -> Response:
        """vLLM's token-in, token-out route (`vllm_generate.py`): verifiers' and prime-rl's training clients."""
        require_model(body.model, model_name)
        return await generate(openai, flows(request), body)

    async def rollout_answer(body: CompletionRequest, request: Request) -> Response:
        """trl_cb's own answer to `/v1/completions` (`encoding="binary"`): every group, then one frame."""
        groups = await flow(body, request).groups()
        if len(groups) < len(body.prompt):  # the client went away: nobody reads this
            raise HTTPException(status_code=499, detail="client disconnected")

        prompt_tokens = sum(len(p) for p in body.prompt)
        generated = sum(len(ids) for group in groups.values() for ids in group.completion_ids)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": prompt_tokens + generated,
        }
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "model": model_name}

        async def frame() -> AsyncIterator[bytes]:
            """One frame (`frames.py`): each group's arrays packed in a worker thread, then the frame's pieces, sent as
            they are, so that no step of a large answer (a join, a socket write of the whole body) holds the event
            loop for long."""
            columns = PackedColumns()
            for i in range(len(body.prompt)):
                columns.extend(await run_in_threadpool(pack_choices, groups[i], i, body, eos_ids))
            for piece in await run_in_threadpool(frame_pieces, {**head, "usage": usage}, columns):
                yield piece

        return StreamingResponse(frame(), media_type=FRAMES_MEDIA_TYPE)

    @app.post("/v1/completions/stream")
    async def completions_stream(body: CompletionRequest, request: Request) -> StreamingResponse:
        """One JSON line (binary: one frame) per group (a prompt's `n` choices) as it finishes, in finishing order;
        errors as a line (frame)."""
        groups = flow(body, request)

        def encode(i: int, group: RolloutGroup) -> bytes:
            if body.encoding == "binary":  # one frame
                return b"".join(frame_pieces({"prompt_index": i}, pack_choices(group, i, body, eos_ids)))
            choices = b"[" + b",".join(encode_choices(group, i, body, eos_ids)) + b"]"
            return b'{"prompt_index": %d, "choices": ' % i + choices + b"}\n"

        async def lines() -> AsyncIterator[str]:
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

    app.include_router(weight_router(engine, weights))

    return app


def serve(app: FastAPI, host: str, port: int, timeout_graceful_shutdown: float = 1.0) -> None:
    """Run `app` (from `create_app`) on uvicorn until SIGINT or SIGTERM.

    On the signal the engine shuts down first (`ServingEngine.shut_down`: every queued or running group, also on a
    paused server, is answered 503 with `Retry-After` while the HTTP server still answers), then uvicorn stops, waiting
    at most `timeout_graceful_shutdown` seconds for the answers to go out. Without that first step uvicorn would
    cancel the waiting requests at its timeout and answer them 500.
    """
    import uvicorn

    class _EngineFirst(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:  # uvicorn's signal handler, on the event loop's thread
            app.state.engine.shut_down()  # does not wait: only posts to the engine loop
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=timeout_graceful_shutdown
    )
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the signal it handled, as `uvicorn.run` does
        _EngineFirst(config).run()


def with_response_parser(tokenizer: Any) -> Any:
    """`tokenizer`, with TRL's response template for its chat template where it has none and TRL knows one (tool
    calls in chat answers are then parsed as TRL parses them for training); unchanged otherwise."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        return tokenizer
    if getattr(tokenizer, "response_template", None) is not None or getattr(tokenizer, "response_schema", None):
        return tokenizer
    from trl.chat_template_utils import add_response_schema

    try:
        return add_response_schema(tokenizer)
    except Exception as exc:  # an unknown template: answers carry the text, tool calls are not parsed out
        logger.info("No response template for this chat template (%s): tool calls are left in the text.", exc)
        return tokenizer


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
