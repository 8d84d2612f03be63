"""The server's side of the weight sync (`weight_sync.py` has the protocol and the trainer's side): one trainer's group
at a time, its announced updates received in the background and applied between two engine steps, each update's
outcome kept for `/weights/wait`."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .gloo_group import broadcast, dtype_named, open_group, store_alive
from .weight_buckets import receive_buckets

__all__ = ["StaleVersion", "UpdateOutcome", "WeightReceiver"]

logger = logging.getLogger(__name__)


class StaleVersion(ValueError):
    """An update whose version is not above every version its owner announced before (HTTP 409)."""


@dataclass(frozen=True)
class UpdateOutcome:
    """What `/weights/wait` answers: `applied`, `pending`, `refused` (bad weights), `failed`, `unknown`."""

    status: str
    detail: str = ""


class WeightReceiver:
    """Server side: one trainer's group at a time; `apply` copies received tensors into the model (under a lock)."""

    def __init__(
        self, model: torch.nn.Module, apply: Callable[[Callable[[], None], int], None], probe_timeout_s: float = 2.0
    ) -> None:
        self.model = model
        self.apply = apply  # apply(copy, version): runs `copy` between two engine steps, then serves `version`
        self.version = 0
        self.last_error: str | None = None
        #: Groups dropped because their trainer was gone when another trainer asked to init (`/metrics`).
        self.dropped_owners = 0
        self.probe_timeout_s = probe_timeout_s
        self._token: str | None = None
        self._address: tuple[str, int] | None = None  # the owner's TCPStore (for the log)
        self._group: tuple[dist.TCPStore, dist.ProcessGroup] | None = None
        self._busy = threading.Lock()  # one init / update at a time
        #: The owner's announced updates: version -> outcome (`pending` until received and applied or refused).
        self._outcomes: dict[int, UpdateOutcome] = {}
        self._changed = threading.Condition()

    def owns(self, token: str) -> bool:
        return self._token is not None and secrets.compare_digest(self._token, token)

    @property
    def is_open(self) -> bool:
        return self._token is not None

    def init(self, host: str, port: int, token: str, timeout_s: float) -> None:
        """Join in a background thread (the trainer's store waits for us, and we for it).

        Invariant: a join that finishes after its owner was replaced (dropped as gone, or closed) touches nothing:
        it neither installs its group nor clears the newer owner's token.
        """
        self._token, self._address = token, (host, port)
        with self._changed:
            self._outcomes = {}  # a new owner: its versions start afresh

        def join() -> None:
            if self._token != token:  # replaced while waiting for `_busy`
                return
            try:
                group = open_group(host, port, timeout_s)
            except Exception:
                if self._token == token:  # a failed join frees the server for the next trainer
                    self._token, self._address = None, None
                raise
            if self._token == token:
                self._group = group

        self._run(join, "init")

    def release_if_owner_gone(self) -> bool:
        """Drop the open group if its trainer is gone; True when the server is now free for another trainer.

        Why: a trainer killed without `/weights/close` would otherwise hold the server until a restart. The trainer
        is the master of the group's `TCPStore`, served from a thread of its own process, so a live trainer answers
        a store request even mid-step, while a dead one's connection was closed by its kernel (or times out, for a
        host that vanished): a store `check` on the group's connection, bounded by `probe_timeout_s`, tells them
        apart. A group still joining is never probed (`WeightSender` opens its store only after `/weights/init`
        answers, so a refused connection then proves nothing): a join that fails frees the server after its
        `timeout_s`. A live owner keeps the group (the caller answers 409).
        """
        token, group = self._token, self._group
        if token is None:
            return True
        if group is None or store_alive(group[0], self.probe_timeout_s):
            return False
        if self._token != token:  # closed or replaced meanwhile: nothing of that owner left to drop
            return self._token is None
        logger.warning(
            "weight-sync owner at %s:%s is gone (its store is unreachable): dropping its group", *self._address
        )
        self._group, self._token, self._address = None, None, None
        self.dropped_owners += 1
        return True

    def update(
        self,
        version: int,
        params: list[tuple[str, str, list[int]]],
        bucket_bytes: int,
        on_done: Callable[[int], None],
    ) -> None:
        """Check the announcement (`ValueError`, `StaleVersion`), then receive (in buckets of up to `bucket_bytes`,
        `weight_buckets.py`) and apply in the background; the outcome is `wait`'s."""
        last = max(self._outcomes, default=0)
        if version <= last:
            raise StaleVersion(
                f"weight version {version} is not above this trainer's last version {last}: versions must strictly "
                "increase (a repeat would let a wait return before the new weights are in place)"
            )
        names = dict(self.model.named_parameters())
        unknown = [name for name, _, _ in params if name not in names]
        if unknown:
            raise ValueError(f"unknown parameter names: {unknown[:5]}")
        for name, dtype, shape in params:
            if list(names[name].shape) != list(shape):
                raise ValueError(f"{name}: shape {shape} differs from the server's {list(names[name].shape)}")
            dtype_named(dtype)
        self.last_error = None
        self._settle(version, UpdateOutcome("pending"))

        def receive() -> None:
            if self._group is None:
                raise RuntimeError("weight-sync group is not open (POST /weights/init first)")
            group = self._group[1]  # every tensor is received, also after a bad one: the trainer broadcasts them all
            layout = [(dtype_named(dtype), shape) for _, dtype, shape in params]
            buffers = receive_buckets(layout, bucket_bytes, lambda flat: broadcast(group, flat))
            received = [(names[name], buffer) for (name, _, _), buffer in zip(params, buffers)]
            bad = [
                name for (name, _, _), b in zip(params, buffers) if b.is_floating_point() and not b.isfinite().all()
            ]
            if bad:
                why = f"weights refused: non-finite values (nan/inf) in {len(bad)} tensor(s), e.g. {bad[:3]}"
                self.last_error = f"update to version {version}: {why}"
                self._settle(version, UpdateOutcome("refused", f"{why}; still serving version {self.version}"))
                logger.warning("weight version %d %s", version, why)
                return

            def copy() -> None:
                for param, buffer in received:
                    param.data.copy_(buffer.to(param.device, param.dtype))

            self.apply(copy, version)  # no engine forward runs while weights are half-copied
            self.version = version
            self._settle(version, UpdateOutcome("applied"))
            on_done(version)

        def failed(exc: BaseException) -> None:
            self._settle(version, UpdateOutcome("failed", f"weight update to version {version} failed: {exc}"))

        self._run(receive, f"update to version {version}", on_error=failed)

    def wait(self, version: int, timeout_s: float) -> UpdateOutcome:
        """The outcome of this owner's update to `version`, waiting up to `timeout_s` while it is pending."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                outcome = self._outcomes.get(version)
                if outcome is None:
                    return UpdateOutcome("unknown", f"weight version {version} was never announced by this trainer")
                left = deadline - time.monotonic()
                if outcome.status != "pending" or left <= 0:
                    return outcome
                self._changed.wait(left)

    def _settle(self, version: int, outcome: UpdateOutcome) -> None:
        with self._changed:
            self._outcomes[version] = outcome
            self._changed.notify_all()

    def close(self) -> None:
        with self._busy:
            self._group, self._token, self._address = None, None, None

    def _run(
        self, work: Callable[[], None], what: str, on_error: Callable[[BaseException], None] | None = None
    ) -> None:
        def target() -> None:
            with self._busy:
                try:
                    work()
                except Exception as exc:  # reported through /metrics and to the waiting trainer
                    logger.exception("weight sync %s failed", what)
                    self.last_error = f"{what}: {exc}"
                    if on_error is not None:
                        on_error(exc)

        threading.Thread(target=target, name=f"trl_cb-weights-{what}", daemon=True).start()
