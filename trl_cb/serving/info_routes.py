"""The rollout server's information routes: `/health`, `/v1/models` (and one model's card), `/version`, `/metrics`,
`/tokenize` and `/detokenize`: what launchers, scrapers and OpenAI / vLLM clients ask besides generation
(docs/server.md, HTTP API). `server.create_app` includes them; the two request checks here (`require_model`,
`converted`) are also its generation routes'.

Invariants: none of these routes submits work to the engine (the card and `/metrics` read its counters); `/health`
does no work at all (a launcher polls it, `launch.py`); a request naming another model gets 404 and a prompt that
cannot be converted 400 naming the reason, each counted as rejected.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import transformers
from fastapi import APIRouter, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from ..version import __version__
from .metrics import PROMETHEUS_CONTENT_TYPE, RequestCounters, metrics_snapshot, prometheus_text, wants_json
from .openai_protocol import DetokenizeRequest, TokenizeRequest, model_not_found

__all__ = ["converted", "info_router", "require_model"]


def require_model(name: str | None, served: str) -> None:
    """404 unless a request names no model or the served one."""
    if name is not None and name != served:
        raise HTTPException(status_code=404, detail="the requested model is not served here (see /v1/models)")


def converted(convert: Callable[[], Any], counters: RequestCounters) -> Any:
    """A request's prompt conversion (tokenizer, chat template: jinja errors too); 400 naming the reason."""
    try:
        return convert()
    except Exception as exc:
        counters.rejected += 1
        raise HTTPException(status_code=400, detail=f"cannot build the prompt: {str(exc)[:300]}") from exc


def info_router(
    model: torch.nn.Module,
    model_name: str,
    engine_loop: Any,
    weights: Any,
    counters: RequestCounters,
    max_model_len: int | None,
    tokenizer: Any,
) -> APIRouter:
    """The routes above for `model` served as `model_name` by `engine_loop` (`EngineLoop`) with `weights`
    (`WeightReceiver`); `tokenizer` may be None (then `/tokenize` and `/detokenize` answer 400)."""
    router = APIRouter()

    def dtype() -> str:
        return str(model.dtype).removeprefix("torch.")

    @router.get("/health")
    async def health() -> dict[str, Any]:
        # On the event loop itself: a sync route would wait for a thread-pool thread, and then for the GIL twice more.
        # The pid lets a launcher tell its own child from another server that holds the port (`launch.py`).
        return {"status": "ok", "pid": os.getpid()}

    def card() -> dict[str, Any]:
        return {
            "id": model_name,
            "object": "model",
            "owned_by": "trl_cb",
            "weight_version": engine_loop.version,
            "dtype": dtype(),
            "max_model_len": max_model_len,
        }

    @router.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @router.get("/v1/models/{model_id:path}")
    def model_card(model_id: str) -> Any:
        """OpenAI's model retrieval; an unknown id gets OpenAI's 404 error object (without echoing the id)."""
        if model_id != model_name:
            counters.rejected += 1
            return JSONResponse(status_code=404, content=model_not_found())
        return card()

    @router.get("/version")
    def version() -> dict[str, str]:
        """vLLM's `/version`: trl_cb's, and the transformers it runs on."""
        return {"version": __version__, "transformers": transformers.__version__}

    @router.get("/metrics")
    def metrics(request: Request) -> Response:
        """Prometheus text, or the JSON object with `Accept: application/json` (`metrics.py`)."""
        snapshot = metrics_snapshot(engine_loop, weights, counters)
        if wants_json(request.headers.get("accept")):
            return JSONResponse(snapshot)
        info = {"model": model_name, "version": __version__, "dtype": dtype()}
        return Response(prometheus_text(snapshot, info), media_type=PROMETHEUS_CONTENT_TYPE)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's `/tokenize`: a text, or messages as the chat template renders them for generation."""
        require_model(body.model, model_name)
        ids = await run_in_threadpool(converted, lambda: body.ids(tokenizer), counters)
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's `/detokenize`: token ids to their text (400 for an id outside the vocabulary)."""
        require_model(body.model, model_name)
        try:
            return {"prompt": await run_in_threadpool(body.text, tokenizer)}
        except ValueError as exc:
            counters.rejected += 1
            raise HTTPException(status_code=400, detail=str(exc)) from exc

    return router
