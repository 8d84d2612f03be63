"""`RequestGate`: the rollout server's one entry check, an ASGI middleware in front of the whole app.

Why one layer: checks attached per route miss the routes the framework adds itself (FastAPI's `/docs`, `/redoc`,
`/openapi.json`, `/docs/oauth2-redirect`), and a check that runs as a route dependency runs only after the body was
read and parsed, so an unauthenticated client could make the server buffer and parse anything it sends.

Invariants, for every HTTP request, in this order:
- With an API key, every path but `/health` needs `Authorization: Bearer KEY`: refused with 401 on the headers, before
  a byte of the body is read.
- A declared `Content-Length` over `max_body_bytes` is refused with 413 on the headers; a body without one (chunked)
  is counted as it arrives and refused with 413 as soon as it passes the limit. The app only sees bodies within it.
- Refusals are short JSON (`{"detail": ...}`) and never echo what was sent.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Paths answered without the API key (liveness probes).
OPEN_PATHS = frozenset({"/health"})


async def _refuse(send: Send, status: int, detail: str, extra_headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),  # the unread rest of a refused body is not waited for
        *extra_headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestGate:
    """Auth and body size for `app` (see the module docstring); `api_key=None` serves without a key."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        if max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be > 0, got {max_body_bytes}")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan (and websockets, which this app has none of)
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])  # ASGI: lower-case byte names
        if self._expected is not None and scope.get("path") not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not secrets.compare_digest(given, self._expected):
                detail = "missing or wrong API key (header 'Authorization: Bearer KEY')"
                await _refuse(send, 401, detail, [(b"www-authenticate", b"Bearer")])
                return
        too_large = f"request body over the server's limit of {self.max_body_bytes} bytes (--max-body-bytes)"
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await _refuse(send, 400, "Content-Length is not a number")
                return
            if int(declared) > self.max_body_bytes:
                await _refuse(send, 413, too_large)
                return
        # Read the body here, counting, so that the app never buffers more than the limit; then replay it.
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away while sending
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _refuse(send, 413, too_large)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: disconnect notices (streamed answers watch for them)

        await self.app(scope, replay, send)
