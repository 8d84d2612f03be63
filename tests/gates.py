"""Gates that make "work still in progress when X happens" true by construction, whatever the machine's speed.

A test of an abort (Ctrl-C, a timeout, `stop()`, a hold) needs the engine to be mid-round when the abort comes. A fixed
sleep against a fixed amount of work only holds on machines as slow as the one the test was written on: on a 3x faster
one the round is over before the sleep ends (issue 30). `EngineGate` instead parks the engine thread inside one of its
forwards and keeps it there until the code under test asks the engine to pause or to stop (or the test releases it),
so the round is provably unfinished when the abort starts, and the abort's own latency is still what is measured.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from transformers.generation.continuous_batching.continuous_api import BackgroundThreadStatus

#: How long a parked engine thread waits at most (a test that forgets to release fails instead of hanging).
GATE_LIMIT_S = 120.0


class EngineGate:
    """Parks the `after`-th engine forward (counted from `arm`) until `release`, or until anyone asks any engine to
    pause (`BackgroundThreadStatus.acquire_pause`) or stop (`request_stop`): both would otherwise wait for the parked
    forward forever. Forwards on the main thread (teacher forcing in the test) are never parked."""

    def __init__(self, after: int = 1) -> None:
        self.after = after
        self.entered = threading.Event()
        self.released = threading.Event()
        self.closed = threading.Event()
        #: True once a forward was parked before anything released the gate: the precondition held.
        self.parked = False
        self._armed = False
        self._seen = 0
        self._lock = threading.Lock()

    def arm(self) -> EngineGate:
        with self._lock:
            self._armed, self._seen = True, 0
        return self

    def release(self) -> None:
        self.released.set()

    def wait_entered(self, timeout: float = 60.0) -> None:
        assert self.entered.wait(timeout), f"the engine ran no forward within {timeout} s"

    def _pre_hook(self, module: torch.nn.Module, args: object) -> None:
        if threading.current_thread() is threading.main_thread():
            return
        with self._lock:
            if not self._armed or self.entered.is_set():
                return
            self._seen += 1
            if self._seen < self.after:
                return
            self.parked = not self.released.is_set()
            self.entered.set()
        assert self.released.wait(GATE_LIMIT_S), "an engine forward stayed parked: nothing released the gate"


@contextmanager
def engine_gate(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, after: int = 1) -> Iterator[EngineGate]:
    """An armed `EngineGate` on `model`'s input embeddings (every engine forward goes through them); released and
    removed on exit."""
    gate = EngineGate(after).arm()
    for name in ("acquire_pause", "request_stop"):
        real = getattr(BackgroundThreadStatus, name)
        monkeypatch.setattr(BackgroundThreadStatus, name, _releasing(gate, real))
    handle = model.get_input_embeddings().register_forward_pre_hook(gate._pre_hook)
    try:
        yield gate
    finally:
        gate.release()
        gate.closed.set()
        handle.remove()


def _releasing(gate: EngineGate, real: Callable) -> Callable:
    def call(self, *args, **kwargs):
        gate.release()
        return real(self, *args, **kwargs)

    return call


def interrupted_in_round(fn: Callable[[], object], gate: EngineGate) -> float | None:
    """Run `fn`; send SIGINT to the main thread once `gate` holds an engine forward (the round provably unfinished).
    Returns the seconds from the signal to the `KeyboardInterrupt` reaching the caller (`None` if `fn` returned)."""
    sent: list[float] = []

    def fire() -> None:
        while not gate.entered.wait(0.01):
            if gate.closed.is_set():
                return
        sent.append(time.monotonic())
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    sender = threading.Thread(target=fire, daemon=True)
    with python_sigint():
        sender.start()
        try:
            fn()
        except KeyboardInterrupt:
            return time.monotonic() - sent[0]
        finally:
            gate.closed.set()
            sender.join()
    return None


@contextmanager
def python_sigint() -> Iterator[None]:
    """SIGINT raises `KeyboardInterrupt` in the main thread for the duration, as in a user's terminal, whatever
    disposition the test process inherited or an earlier test left (an ignored SIGINT would make every Ctrl-C
    test pass its round to the end); the previous disposition is restored after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class EngineThrottle:
    """Lets the engine start a forward only with a permit (`step` grants them), so a test decides how far the engine
    gets between two of its own actions, whatever the two threads' speeds: e.g. "the engine started a forward while
    the trainer's forward was in progress", or "at most k tokens between two weight updates".

    While any thread asks the engine to pause or stop, permits are not needed (a forward parked for a permit would
    otherwise keep the loop from ever reaching the pause); `open` lets it run freely for good. Forwards on the main
    thread are never throttled."""

    def __init__(self) -> None:
        self.started = 0
        self._permits = 0
        self._free = 0
        self._open = False
        self._changed = threading.Condition()

    def step(self, n: int = 1, timeout: float = 60.0) -> None:
        """Grant `n` forwards and wait until the engine has started them."""
        with self._changed:
            target = self.started + n
            self._permits += n
            self._changed.notify_all()
            assert self._changed.wait_for(lambda: self.started >= target, timeout), "the engine stopped stepping"

    def open(self) -> None:
        with self._changed:
            self._open = True
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._open, self._permits = False, 0

    def _pre_hook(self, module: torch.nn.Module, args: object) -> None:
        if threading.current_thread() is threading.main_thread():
            return
        with self._changed:
            free = lambda: self._open or self._free > 0  # noqa: E731
            assert self._changed.wait_for(lambda: self._permits > 0 or free(), GATE_LIMIT_S), "no permit came"
            if not free():
                self._permits -= 1
            self.started += 1
            self._changed.notify_all()

    def _freed(self, real: Callable, delta: int) -> Callable:
        def call(status, *args, **kwargs):
            if delta > 0:
                with self._changed:
                    self._free += delta
                    self._changed.notify_all()
            try:
                return real(status, *args, **kwargs)
            finally:
                if delta < 0:
                    with self._changed:
                        self._free += delta

        return call


@contextmanager
def engine_throttle(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineThrottle]:
    """An `EngineThrottle` on `model`'s input embeddings (every engine forward goes through them), opened and removed
    on exit."""
    throttle = EngineThrottle()
    monkeypatch.setattr(
        BackgroundThreadStatus, "acquire_pause", throttle._freed(BackgroundThreadStatus.acquire_pause, 1)
    )
    monkeypatch.setattr(
        BackgroundThreadStatus, "release_pause", throttle._freed(BackgroundThreadStatus.release_pause, -1)
    )
    real_stop = BackgroundThreadStatus.request_stop

    def stop(status, *args, **kwargs):
        throttle.open()
        return real_stop(status, *args, **kwargs)

    monkeypatch.setattr(BackgroundThreadStatus, "request_stop", stop)
    handle = model.get_input_embeddings().register_forward_pre_hook(throttle._pre_hook)
    try:
        yield throttle
    finally:
        throttle.open()
        handle.remove()
