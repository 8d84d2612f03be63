"""The rollout server's weight routes: `/pause` and `/resume` of the engine, and the weight sync a trainer drives
(`/weights/init`, `/update`, `/wait`, `/close`; the protocol: `weight_sync.py`, the server's side:
`weight_receiver.py`). `server.create_app` includes them.

Invariants: one trainer owns the open weight-sync group; every route after `/weights/init` checks its token in one
place (`require_owner`, else 403); a live owner's group is never taken over (409), a dead one's is
(`release_if_owner_gone`); versions strictly increase per owner (409 otherwise); `/weights/wait` answers the update's
outcome, not a poll of `/metrics`.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, HTTPException
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from .protocol import WeightsClose, WeightsInit, WeightsUpdate, WeightsWait, WeightsWaitResponse
from .weight_receiver import StaleVersion, WeightReceiver

logger = logging.getLogger(__name__)

__all__ = ["require_owner", "weight_router"]


def require_owner(weights: WeightReceiver, token: str) -> None:
    """403 unless `token` is the one the open weight-sync group was initialised with: every weight route after
    `/weights/init` is the owning trainer's alone."""
    if not weights.owns(token):
        raise HTTPException(status_code=403, detail="token does not match the trainer that opened the group")


def weight_router(engine_loop: Any, weights: WeightReceiver) -> APIRouter:
    """The routes above on `engine_loop` (`EngineLoop`: paused, resumed, its version read) and `weights`."""
    router = APIRouter()

    @router.post("/pause")
    def pause() -> dict[str, bool]:
        engine_loop.set_paused(True)
        return {"paused": True}

    @router.post("/resume")
    def resume() -> dict[str, bool]:
        engine_loop.set_paused(False)
        return {"paused": False}

    @router.post("/weights/init")
    def weights_init(body: WeightsInit) -> dict[str, str]:
        # A trainer that died without closing its group (SIGKILL, OOM) is dropped here; a live one keeps it: 409.
        if weights.is_open and not weights.owns(body.token) and not weights.release_if_owner_gone():
            raise HTTPException(status_code=409, detail="a weight-sync group is already open for another trainer")
        weights.init(body.host, body.port, body.token, body.timeout_s)
        return {"status": "joining"}

    @router.post("/weights/update")
    def weights_update(body: WeightsUpdate) -> dict[str, str]:
        require_owner(weights, body.token)
        try:
            weights.update(
                body.version,
                body.params,
                body.bucket_bytes,
                on_done=lambda v: logger.info("serving weight version %d", v),
            )
        except StaleVersion as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from exc
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        return {"status": "receiving"}

    @router.post("/weights/wait")
    async def weights_wait(body: WeightsWait) -> JSONResponse:
        """The update's outcome once known (see `WeightsWait`); the trainer's push ends on this, not on `/metrics`."""
        require_owner(weights, body.token)
        outcome = await run_in_threadpool(weights.wait, body.version, body.timeout_s)
        if outcome.status == "applied" or outcome.status == "pending":
            answer = WeightsWaitResponse(status=outcome.status, weight_version=engine_loop.version)
            return JSONResponse(status_code=200 if outcome.status == "applied" else 202, content=answer.model_dump())
        status = {"unknown": 404, "refused": 400}.get(outcome.status, 500)
        raise HTTPException(status_code=status, detail=outcome.detail)

    @router.post("/weights/close")
    def weights_close(body: WeightsClose) -> dict[str, str]:
        require_owner(weights, body.token)
        weights.close()
        return {"status": "closed"}

    return router
