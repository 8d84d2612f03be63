"""`RequestFlow`: one HTTP request's groups on the shared `EngineLoop`, from submission to the last group, as
the routes consume them (`generation_routes.py`: trl_cb's answers; `openai_serving.py`: OpenAI's).

Invariants: constructing the flow checks the prompts and settings and submits the groups (so a bad request fails
before any answer starts: `HTTPException` 400 naming the reason); iterating yields what the groups' watchers post and
each group as it ends, in finishing order, each once; a failed group raises (`refusal`: 400 for a refused setting or
prompt, 503 with `Retry-After` while the server shuts down, 500 otherwise); a client that disconnects, or a consumer
that stops early, cancels every group still running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import HTTPException, Request

from .engine_loop import ServerShuttingDown, Ticket

__all__ = ["RETRY_AFTER_S", "RequestFlow", "Submit", "refusal"]

#: `Retry-After` of a 503 from a server shutting down: a replica restarting, or another one, can take the retry.
RETRY_AFTER_S = 1

#: How often a request waiting for its groups checks that its client is still connected.
DISCONNECT_POLL_S = 0.25

#: `submit(prompts, n, max_new_tokens, sampling, on_done, watchers) -> tickets`: the server's checked submission.
Submit = Callable[..., list[Ticket]]


def refusal(error: BaseException) -> HTTPException:
    """The HTTP answer to a group that failed, or a submission refused, with `error`: one mapping for every route."""
    if isinstance(error, ServerShuttingDown):  # nothing wrong with the request: the client may send it again
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        return HTTPException(status_code=503, detail=f"generation failed: {error}; retry", headers=headers)
    status = 400 if isinstance(error, ValueError) else 500
    return HTTPException(status_code=status, detail=f"generation failed: {error}")


class RequestFlow:
    """See the module docstring. `install(post)` returns one watcher per prompt (or None each); watchers run on the
    engine loop and hand items to this request with `post` (safe from any thread, a no-op once it ended)."""

    def __init__(
        self,
        submit: Submit,
        engine_loop: Any,
        request: Request,
        prompts: list[list[int]],
        n: int,
        max_new_tokens: int,
        sampling: dict[str, Any],
        install: Callable[[Callable[[Any], None]], list[Any]] | None = None,
        on_end: Callable[[], None] | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def post(item: tuple[str, Any]) -> None:
            with contextlib.suppress(RuntimeError):  # the request's loop is gone: nobody to tell
                loop.call_soon_threadsafe(self._queue.put_nowait, item)

        self._engine_loop, self._request, self._on_end = engine_loop, request, on_end
        watchers = install(post) if install is not None else None
        self.tickets = submit(prompts, n, max_new_tokens, sampling, lambda t: post(("done", t)), watchers)
        self._index = {id(ticket): i for i, ticket in enumerate(self.tickets)}

    async def __aiter__(self) -> AsyncIterator[tuple[str, Any]]:
        """("group", (prompt index, group)) as each group ends, and whatever watchers posted, in arrival order."""
        remaining = len(self.tickets)
        try:
            while remaining:
                try:
                    kind, payload = await asyncio.wait_for(self._queue.get(), timeout=DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await self._request.is_disconnected():
                        return
                    continue
                if kind != "done":
                    yield kind, payload
                    continue
                ticket: Ticket = payload
                if ticket.error is not None:
                    raise refusal(ticket.error)
                remaining -= 1
                yield "group", (self._index[id(ticket)], ticket.group)
        finally:
            if not all(ticket.done.is_set() for ticket in self.tickets):
                self._engine_loop.cancel(
                    self.tickets
                )  # the client went away (or a group failed): stop what still runs
            if self._on_end is not None:
                self._on_end()

    def cancel(self) -> None:
        """Stop this request's groups (its answer failed before they were read)."""
        self._engine_loop.cancel(self.tickets)

    async def groups(self) -> dict[int, Any]:
        """Every group by prompt index (watchers' items skipped); fewer than the prompts if the client left."""
        found = {}
        async for kind, payload in self:
            if kind == "group":
                found[payload[0]] = payload[1]
        return found
