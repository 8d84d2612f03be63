"""The rollout server's HTTP app: one persistent CB engine, stepped by its `EngineLoop`, behind FastAPI
(docs/server.md). `create_app` builds the engine loop and assembles the route modules (`info_routes.py`,
`generation_routes.py`, `weight_routes.py`) behind `middleware.RequestGate`; `serve` runs it.

Invariants: concurrent requests share the engine's batch (`engine_loop.py`); weights move between two engine steps, and
every token reports the `weight_version` that sampled it (`token_weight_versions`; a choice's `weight_version` is its
oldest token's). A client that disconnects cancels its groups. Bad requests get 4xx naming the reason and leave the
server serving; a 4xx never echoes the request's values. `middleware.RequestGate` fronts the whole app: with an API
key every path but `/health` (FastAPI's own docs routes too) requires `Authorization: Bearer KEY`, refused with 401 on
the headers before any body is read, and bodies over `max_body_bytes` get 413 while being read. Weight updates, waits
and close also require the init token (`weight_routes.require_owner`, else 403); versions strictly increase per owner
(else 409), and non-finite weights are refused (400 from `/weights/wait`) with the served weights unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from transformers import GenerationConfig

from ..rollouts.generator import ContinuousBatchingGenerator
from .engine_loop import EngineLoop
from .generation_routes import Generation, generation_router
from .info_routes import info_router
from .metrics import RequestCounters
from .middleware import RequestGate
from .openai_protocol import OpenAIError
from .openai_serving import OpenAIServing
from .protocol import DEFAULT_MAX_BODY_BYTES
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
    turns), never across a weight update (`EngineLoop`).
    """
    defaults = {"eos_token_id": model.generation_config.eos_token_id, "pad_token_id": model.config.pad_token_id}
    defaults.update(generation_defaults or {})
    model.eval()
    # Requests with different temperature / top_k / top_p share the running engine (engine_loop.py), unless turned off.
    engine_config = {"per_request_processors": True, **(continuous_batching_config or {})}
    generator = ContinuousBatchingGenerator(
        model, GenerationConfig(do_sample=True, max_new_tokens=16, **defaults), engine_config
    )
    per_request = bool(engine_config["per_request_processors"])
    engine_loop = EngineLoop(generator, model, max_num_seqs, per_request=per_request, share_prefixes=prefix_caching)
    weights = WeightReceiver(model, engine_loop.apply_weights)
    counters = RequestCounters()
    eos = defaults.get("eos_token_id")
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    #: The context: prompt + completion budget past it is refused with vLLM's wording (`context_overflow`).
    max_model_len = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    openai = OpenAIServing(with_response_parser(tokenizer), model_name, eos_ids)
    generation = Generation(
        model, model_name, generator, engine_loop, defaults, engine_config, counters, tokenizer, max_model_len, openai,
        eos_ids,
    )  # fmt: skip

    app = FastAPI(title="trl_cb rollout server")
    app.add_middleware(RequestGate, api_key=api_key, max_body_bytes=max_body_bytes)  # auth and size, on headers
    app.state.engine_loop = engine_loop
    _answer_refusals(app, counters)
    app.include_router(info_router(model, model_name, engine_loop, weights, counters, max_model_len, tokenizer))
    app.include_router(generation_router(generation))
    app.include_router(weight_router(engine_loop, weights))
    return app


def _answer_refusals(app: FastAPI, counters: RequestCounters) -> None:
    """The app's answers to a body that fails validation (422) and to an OpenAI-shaped refusal (`OpenAIError`)."""

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


def serve(
    app: FastAPI,
    host: str,
    port: int,
    timeout_graceful_shutdown: float = 1.0,
    gil_switch_interval_ms: float | None = None,
) -> None:
    """Run `app` (from `create_app`) on uvicorn until SIGINT or SIGTERM.

    On the signal the engine shuts down first (`EngineLoop.shut_down`: every queued or running group, also on a
    paused server, is answered 503 with `Retry-After` while the HTTP server still answers), then uvicorn stops, waiting
    at most `timeout_graceful_shutdown` seconds for the answers to go out. Without that first step uvicorn would
    cancel the waiting requests at its timeout and answer them 500. `gil_switch_interval_ms`: the interpreter's GIL
    hand-over interval for this process (`sys.setswitchinterval`; Python's default is 5 ms): the event loop waits up
    to about that long behind each busy thread (the engine's, the answers'), docs/benchmarks.md measures the trade.
    """
    import uvicorn

    if gil_switch_interval_ms is not None:
        sys.setswitchinterval(gil_switch_interval_ms / 1000)

    class _EngineFirst(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:  # uvicorn's signal handler, on the event loop's thread
            app.state.engine_loop.shut_down()  # does not wait: only posts to the engine loop
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
