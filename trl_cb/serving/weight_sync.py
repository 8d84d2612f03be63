"""Weight sync between one trainer (rank 0) and one rollout server (rank 1) over a gloo group of their own.

The group is built from its own `TCPStore` (the trainer is the store's master) and never touches
`torch.distributed`'s default group, so it lives beside the trainer's accelerate group. Protocol (docs/server.md):
the trainer opens its store, POSTs `/weights/init` (the server joins in a thread) and joins; per update it POSTs
`/weights/update` with the parameter list, broadcasts each parameter in that order, and POSTs `/weights/wait`, which
answers with that update's outcome. The server receives every tensor first, refuses the update if any is non-finite
(the served weights stay as they were), else copies them into its model between two engine steps
(`ServingEngine.apply_weights`), so no forward ever sees half-updated weights and in-flight requests continue. Only
the holder of the init `token` may update, wait or close; its versions must strictly increase (`StaleVersion`), so a
wait for a version always waits for that update, never for an earlier one that happened to carry the same number.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import requests
import torch
import torch.distributed as dist
from pydantic import BaseModel

from ..engine.weight_export import WeightSpec
from ..errors import RolloutServerError
from .client import retrying_session
from .gloo_group import (
    address_towards,
    broadcast,
    dtype_named,
    free_port,
    join_group,
    listen_store,
    open_group,
    store_alive,
)
from .protocol import WeightsClose, WeightsInit, WeightsUpdate, WeightsWait

__all__ = [
    "StaleVersion",
    "UpdateOutcome",
    "WeightReceiver",
    "WeightSender",
    "address_towards",
    "free_port",
    "push_weights",
]

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

    def update(self, version: int, params: list[tuple[str, str, list[int]]], on_done: Callable[[int], None]) -> None:
        """Check the announcement (`ValueError`, `StaleVersion`), then receive and apply in the background; the
        outcome is `wait`'s."""
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
            received, bad = [], []
            for name, dtype, shape in params:
                buffer = torch.empty(shape, dtype=dtype_named(dtype))
                broadcast(self._group[1], buffer)  # every tensor is received, also after a bad one: the trainer
                received.append((names[name], buffer))  # broadcasts them all
                if buffer.is_floating_point() and not bool(torch.isfinite(buffer).all()):
                    bad.append(name)
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


class WeightSender:
    """Trainer side of one server's weight-sync group: `init`, per update `begin` / `send` each tensor / `wait`
    (`push_weights` drives several servers from one pass over the weights), `close`. Only one process holds it.

    `pushed_versions` holds every version this sender made the server serve (0: the server's initial weights). HTTP
    calls share one session that retries connection errors and 502/503 (`retries`, `backoff_s`) before failing.
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        host: str | None = None,
        timeout: float = 60.0,
        retries: int = 3,
        backoff_s: float = 0.2,
    ) -> None:
        self.url = url.rstrip("/")
        #: The address the server connects back to (the group's store): by default this machine's address on the
        #: route to the server (loopback for a local one, the interface that reaches another node otherwise).
        self.host = host or address_towards(self.url)
        self.timeout = timeout
        self.pushed_versions: set[int] = {0}
        self._session = retrying_session(api_key, retries, backoff_s)
        self._token = secrets.token_hex(16)
        self._group: tuple[dist.TCPStore, dist.ProcessGroup] | None = None

    def _request(
        self,
        method: str,
        path: str,
        body: BaseModel | None = None,
        ok: tuple[int, ...] = (200,),
        timeout: float | None = None,
    ) -> Any:
        """(status, JSON answer) of one call; `RolloutServerError` for a transport failure or a status not in `ok`."""
        try:
            payload = None if body is None else body.model_dump()
            response = self._session.request(method, self.url + path, json=payload, timeout=timeout or self.timeout)
        except requests.RequestException as exc:
            raise RolloutServerError(f"{self.url}{path}: {exc}") from exc
        if response.status_code not in ok:
            raise RolloutServerError(f"{self.url}{path}: HTTP {response.status_code} {response.text[:500]}")
        try:
            return response.status_code, response.json()
        except ValueError as exc:
            raise RolloutServerError(f"{self.url}{path}: answer is not JSON: {response.text[:200]!r}") from exc

    def _post(self, path: str, body: BaseModel) -> Any:
        return self._request("POST", path, body)[1]

    def init(self) -> None:
        """Open the group: the store listens first, then the server is told where to join (`listen_store`: why)."""
        store = listen_store(self.host, self.timeout)
        self._post(
            "/weights/init", WeightsInit(host=self.host, port=store.port, token=self._token, timeout_s=self.timeout)
        )
        self._group = store, join_group(store, 0, self.timeout)

    def server_dtype(self) -> torch.dtype | None:
        """The dtype the server holds its weights in (`/v1/models` card), None from a server that does not say."""
        _, answer = self._request("GET", "/v1/models")
        try:
            name = answer["data"][0].get("dtype")
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise RolloutServerError(f"{self.url}/v1/models: no model card in {str(answer)[:200]}") from exc
        return dtype_named(name) if name else None

    def begin(self, specs: list[WeightSpec], version: int) -> None:
        """Announce the tensors `send` broadcasts next, in this order (the server allocates, starts receiving)."""
        if self._group is None:
            self.init()
        params = [(s.name, str(s.dtype), list(s.shape)) for s in specs]
        self._post("/weights/update", WeightsUpdate(token=self._token, version=version, params=params))

    def send(self, tensor: torch.Tensor) -> None:
        """Broadcast the next announced tensor (CPU, contiguous, in the announced dtype: the caller casts)."""
        broadcast(self._group[1], tensor)

    def wait(self, version: int) -> None:
        """Block until the server serves `version` (`/weights/wait`: that update's own outcome), bounded by the
        timeout; `RolloutServerError` when it refused or failed the update."""
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RolloutServerError(f"{self.url}: weight version {version} not applied within {self.timeout} s")
            wait_s = min(left, 30.0)  # the server answers 202 after this: the read timeout leaves it room to
            body = WeightsWait(token=self._token, version=version, timeout_s=wait_s)
            status, _ = self._request("POST", "/weights/wait", body, ok=(200, 202), timeout=wait_s + 10.0)
            if status == 200:
                self.pushed_versions.add(version)
                return

    def push(self, model: torch.nn.Module, version: int) -> None:
        """Send every parameter of a plain, unsharded `model` (no PEFT merge, no gathering) and wait for `version`."""
        params = [(name, p.detach()) for name, p in model.named_parameters()]
        specs = [WeightSpec(name, p.dtype, tuple(p.shape)) for name, p in params]
        push_weights([self], specs, iter(params), version)

    def close(self) -> None:
        if self._group is not None:
            self._group = None
            self._post("/weights/close", WeightsClose(token=self._token))


def push_weights(
    senders: list[WeightSender],
    specs: list[WeightSpec],
    weights: Iterator[tuple[str, torch.Tensor]],
    version: int,
    dtypes: list[torch.dtype | None] | None = None,
) -> dict[WeightSender, str]:
    """Send `weights` (one `(name, tensor)` per spec, in order) to every sender's server, then wait for `version`;
    return the senders whose server failed (a dead or broken replica), with the reason.

    Each tensor is gathered once and broadcast to every server, cast on the way to that server's dtype (`dtypes[i]`,
    None: the spec's), so a server never converts and the trainer holds one parameter (plus its casts) at a time.
    A replica that fails is skipped from then on, and the caller must stop sampling from it (it kept older weights).
    `weights` is consumed to the end whatever fails (on a multi-process trainer the other ranks are in the same
    gathers); `RolloutServerError` when every replica failed, and the first error when the weights are not those
    announced.
    """
    dtypes = dtypes or [None] * len(senders)
    announced = {
        sender: [WeightSpec(spec.name, dtype or spec.dtype, spec.shape) for spec in specs]
        for sender, dtype in zip(senders, dtypes)
    }
    failed: dict[WeightSender, str] = {}
    mismatch: Exception | None = None

    def attempt(sender: WeightSender, work: Callable[[], None]) -> None:
        if sender not in failed:
            try:
                work()
            except Exception as exc:  # noqa: BLE001 - this replica is dropped; the others go on
                failed[sender] = f"{type(exc).__name__}: {exc}"

    for sender in senders:
        attempt(sender, lambda sender=sender: sender.begin(announced[sender], version))
    with torch.no_grad():
        for index, (name, tensor) in enumerate(weights):
            if mismatch is not None or len(failed) == len(senders):
                continue  # keep taking part in the gathers
            if name != specs[index].name:
                mismatch = RuntimeError(f"weight {index} is {name!r}, announced {specs[index].name!r}")
                continue
            casts: dict[torch.dtype, torch.Tensor] = {}
            for sender in senders:
                dtype = announced[sender][index].dtype
                if dtype not in casts:
                    casts[dtype] = tensor.to(device="cpu", dtype=dtype).contiguous()
                attempt(sender, lambda sender=sender, t=casts[dtype]: sender.send(t))
    if mismatch is not None:
        raise mismatch
    for sender in senders:
        attempt(sender, lambda sender=sender: sender.wait(version))
    if len(failed) == len(senders):
        reasons = "; ".join(f"{sender.url}: {why}" for sender, why in failed.items())
        raise RolloutServerError(f"weight version {version} reached no rollout server ({reasons})")
    return failed
