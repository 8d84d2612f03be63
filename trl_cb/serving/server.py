"""The rollout server's HTTP app: one `ContinuousBatchingGenerator` behind FastAPI (docs/server.md).

Invariants: one generation round at a time (a lock serialises rounds: the generator is not re-entrant), and weights
change only between rounds, under the same lock, so every completion was sampled from exactly one `weight_version`.
Bad requests get 4xx naming the reason and leave the server serving. With an API key, every endpoint but `/health`
requires `Authorization: Bearer KEY` (else 401); weight updates and close also require the init token (else 403).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from typing import Any

import torch
from fastapi import Depends, FastAPI, HTTPException, Request
from transformers import GenerationConfig

from ..checks.inputs import validate_prompts
from ..rollouts.generator import ContinuousBatchingGenerator
from .protocol import (
    Choice,
    CompletionRequest,
    CompletionResponse,
    WeightsClose,
    WeightsInit,
    WeightsUpdate,
)
from .weight_sync import WeightReceiver

logger = logging.getLogger(__name__)


class _State:
    """Counters `/metrics` reports (every name always present)."""

    def __init__(self) -> None:
        self.requests_served = 0
        self.requests_rejected = 0
        self.tokens_generated = 0
        self.started = time.time()


def create_app(
    model: torch.nn.Module,
    model_name: str = "model",
    generation_defaults: dict[str, Any] | None = None,
    api_key: str | None = None,
    continuous_batching_config: dict[str, Any] | None = None,
) -> FastAPI:
    """An app serving `model` (a transformers causal LM) with trl_cb's engine.

    `generation_defaults`: `GenerationConfig` fields every request starts from (e.g. `eos_token_id`,
    `pad_token_id`); request fields (`max_tokens`, `temperature`, `top_p`, `top_k`) override them.
    """
    defaults = {"eos_token_id": model.generation_config.eos_token_id, "pad_token_id": model.config.pad_token_id}
    defaults.update(generation_defaults or {})
    generator = ContinuousBatchingGenerator(
        model, GenerationConfig(do_sample=True, max_new_tokens=16, **defaults), continuous_batching_config
    )
    lock = threading.Lock()
    state = _State()
    weights = WeightReceiver(model, lock)

    def authorized(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise HTTPException(
                status_code=401, detail="missing or wrong API key (header 'Authorization: Bearer KEY')"
            )

    app = FastAPI(title="trl_cb rollout server")
    app.state.generator = generator
    guarded = [Depends(authorized)]

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=guarded)
    def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "owned_by": "trl_cb", "weight_version": weights.version}
        card["dtype"] = str(model.dtype).removeprefix("torch.")  # trainers cast pushed weights to it
        return {"object": "list", "data": [card]}

    @app.get("/metrics", dependencies=guarded)
    def metrics() -> dict[str, Any]:
        return {
            "requests_served": state.requests_served,
            "requests_rejected": state.requests_rejected,
            "tokens_generated": state.tokens_generated,
            "weight_version": weights.version,
            "weight_sync_open": weights.is_open,
            "weight_sync_error": weights.last_error,
            "uptime_s": time.time() - state.started,
        }

    @app.post("/v1/completions", dependencies=guarded)
    def completions(body: CompletionRequest) -> CompletionResponse:
        try:  # before waiting for the lock: a bad request is refused at once
            validate_prompts(body.prompt, model, body.max_tokens, continuous_batching_config or {})
        except ValueError as exc:
            state.requests_rejected += 1
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        config = GenerationConfig(
            do_sample=True,
            max_new_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            **defaults,
        )
        with lock:
            try:
                result = generator.generate(body.prompt, body.n, generation_config=config)
            except ValueError as exc:  # settings the engine cannot apply exactly
                state.requests_rejected += 1
                raise HTTPException(status_code=400, detail=str(exc)) from exc
            version = weights.version
        eos = defaults.get("eos_token_id")
        choices = [
            Choice(
                index=i,
                prompt_index=i // body.n,
                token_ids=ids,
                logprobs=result.logprobs[i],
                policy_logprobs=result.policy_logprobs[i] if result.policy_logprobs else result.logprobs[i],
                weight_version=version,
                finish_reason="stop" if ids and ids[-1] == eos else "length",
            )
            for i, ids in enumerate(result.completion_ids)
        ]
        generated = sum(len(ids) for ids in result.completion_ids)
        state.requests_served += 1
        state.tokens_generated += generated
        prompt_tokens = sum(len(p) for p in body.prompt)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": prompt_tokens + generated,
        }
        return CompletionResponse(id=f"cmpl-{uuid.uuid4().hex}", model=model_name, choices=choices, usage=usage)

    @app.post("/weights/init", dependencies=guarded)
    def weights_init(body: WeightsInit) -> dict[str, str]:
        if weights.is_open and not weights.owns(body.token):
            raise HTTPException(status_code=409, detail="a weight-sync group is already open for another trainer")
        weights.init(body.host, body.port, body.token, body.timeout_s)
        return {"status": "joining"}

    @app.post("/weights/update", dependencies=guarded)
    def weights_update(body: WeightsUpdate) -> dict[str, str]:
        if not weights.owns(body.token):
            raise HTTPException(status_code=403, detail="token does not match the trainer that opened the group")
        try:
            weights.update(body.version, body.params, on_done=lambda v: logger.info("serving weight version %d", v))
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        return {"status": "receiving"}

    @app.post("/weights/close", dependencies=guarded)
    def weights_close(body: WeightsClose) -> dict[str, str]:
        if not weights.owns(body.token):
            raise HTTPException(status_code=403, detail="token does not match the trainer that opened the group")
        weights.close()
        return {"status": "closed"}

    return app
