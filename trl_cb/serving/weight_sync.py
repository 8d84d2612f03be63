"""Weight sync between one trainer (rank 0) and one rollout server (rank 1) over a gloo group of their own: the
protocol and the trainer's side (`WeightSender`, `push_weights`); the server's is `weight_receiver.py`.

The group is built from its own `TCPStore` (the trainer is the store's master) and never touches
`torch.distributed`'s default group, so it lives beside the trainer's accelerate group. Protocol (docs/server.md):
the trainer opens its store, POSTs `/weights/init` (the server joins in a thread) and joins; per update it POSTs
`/weights/update` with the parameter list, broadcasts the parameters in that order, packed in flat buffers
(`weight_buckets.py`), and POSTs `/weights/wait`, which answers with that update's outcome. The server receives every
tensor first, refuses the update if any is non-finite (the served weights stay as they were), else copies them into
its model between two engine steps (`EngineLoop.apply_weights`), so no forward ever sees half-updated weights and
in-flight requests continue. Only the holder of the init `token` may update, wait or close; its versions must
strictly increase (`StaleVersion`), so a wait for a version always waits for that update, never for an earlier one
that happened to carry the same number.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import requests
import torch
import torch.distributed as dist
from pydantic import BaseModel

from ..engine.weight_export import WeightSpec
from ..errors import RolloutServerError
from .client import retrying_session
from .gloo_group import address_towards, broadcast, dtype_named, free_port, join_group, listen_store
from .protocol import WeightsClose, WeightsInit, WeightsUpdate, WeightsWait
from .weight_buckets import DEFAULT_BUCKET_BYTES, BucketPacker

__all__ = ["WeightSender", "address_towards", "free_port", "push_weights"]

logger = logging.getLogger(__name__)


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
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.url = url.rstrip("/")
        self.bucket_bytes = bucket_bytes  # tensors travel packed in flat buffers of up to this size (0: one by one)
        self._packer: BucketPacker | None = None
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
        self._packer = BucketPacker([(s.dtype, s.shape) for s in specs], self.bucket_bytes)
        body = WeightsUpdate(token=self._token, version=version, params=params, bucket_bytes=self.bucket_bytes)
        self._post("/weights/update", body)

    def send(self, tensor: torch.Tensor) -> None:
        """Take the next announced tensor (CPU, contiguous, in the announced dtype: the caller casts); broadcast its
        bucket once complete."""
        flat = self._packer.add(tensor)
        if flat is not None:
            broadcast(self._group[1], flat)

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
