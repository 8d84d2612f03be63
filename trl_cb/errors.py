"""Exceptions a generation round can raise. A round either returns every requested completion or raises one of
these (or `ValueError` for bad input, before anything is submitted): never fewer or shifted results."""

from __future__ import annotations


class GenerationError(RuntimeError):
    """A request failed inside the CB engine. The round is abandoned; nothing partial is returned."""

    def __init__(self, request_id: str, cause: str) -> None:
        super().__init__(f"Continuous batching request {request_id!r} failed: {cause}")
        self.request_id = request_id
        self.cause = cause


class EngineDiedError(RuntimeError):
    """The CB engine's background thread stopped (or refused work) while requests were outstanding."""


class RolloutServerError(RuntimeError):
    """No rollout server could serve a request: every replica failed (connection error, timeout, 5xx) or sent a
    completion the client cannot accept. The message names each URL and why it failed."""
