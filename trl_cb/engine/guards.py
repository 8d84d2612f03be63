"""Guards around the engine's thread: one round per module at a time, interrupt-safe cleanup, engines closed at exit.

The CB engine runs forwards of the shared training module on its own thread (why each guard exists, as measured:
docs/architecture.md, "Guards"). `module_lock` serialises rounds on a module; `deferred_interrupts` records SIGINT
while an engine thread may run and lets the code raise it at a safe point; `close_at_exit` closes registered objects
before the interpreter joins non-daemon threads.

Invariants: `deferred_interrupts` only changes the main thread's SIGINT handler, restores it exactly, and delivers
what the original handler produced exactly once (a third SIGINT while one is pending is delivered at once); shields
nest (an inner one reuses the active one).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

_locks_guard = threading.Lock()
_module_locks: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()

#: How often a thread waiting for a round lock checks for Ctrl-C and its deadline.
_LOCK_POLL_SECONDS = 0.05
#: SIGINTs (while one is already pending) after which the handler stops deferring and raises at once.
_ESCAPE_AFTER = 2


def module_lock(module: Any) -> threading.RLock:
    """The lock that serialises engine rounds on `module` (one per module object, dropped with the module).

    Held by `ContinuousBatchingGenerator.generate` for a whole round and by the async `EngineBackend` whenever its
    engine may run. Reentrant so that a holder may call helpers that take it again (e.g. `stop` -> `close`).
    """
    with _locks_guard:
        lock = _module_locks.get(module)
        if lock is None:
            lock = threading.RLock()
            _module_locks[module] = lock
        return lock


@contextlib.contextmanager
def acquired(lock: threading.RLock, timeout: float | None = None, what: str = "the model") -> Iterator[None]:
    """Hold `lock`, waiting at most `timeout` seconds (`None`: no limit) before a `TimeoutError` naming `what`.

    Ctrl-C interrupts the wait, but can never land between acquiring the lock and owning its release (a lock
    leaked that way would block every other thread's round forever)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    held = False
    try:
        with deferred_interrupts() as shield:
            while not held:
                held = lock.acquire(timeout=_LOCK_POLL_SECONDS)
                if not held:
                    shield.check()
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(
                            f"Waited {timeout} s for {what}: another generation round on this model is running."
                        )
        yield
    finally:
        if held:
            lock.release()


class InterruptShield:
    """Records SIGINT instead of raising it wherever the main thread happens to be; see the module docstring.

    `pending` is the exception the original handler raised (normally `KeyboardInterrupt`). Code inside the shield
    calls `check()` at points where raising is safe; whatever is still pending when the shield closes is raised
    there.
    """

    def __init__(self) -> None:
        self.pending: BaseException | None = None
        self._delivered = False
        self._extra = 0
        self._original: Any = None
        self._redeliver = False

    def check(self) -> None:
        """Raise the recorded interrupt, if any (at most once)."""
        if self.pending is not None and not self._delivered:
            self._delivered = True
            raise self.pending

    def _handler(self, signum: int, frame: Any) -> None:
        if self.pending is not None:
            self._extra += 1
            if self._extra >= _ESCAPE_AFTER:  # the user insists: stop deferring (state stays retryable)
                raise KeyboardInterrupt
            return
        original = self._original
        if original == signal.SIG_IGN:
            return
        if original == signal.SIG_DFL:  # the process would have died: do so once the engine is stopped
            self._redeliver = True
            self.pending = KeyboardInterrupt()
            return
        try:
            original(signum, frame)
        except BaseException as exc:  # noqa: BLE001 - whatever the user's handler raises is what we deliver
            self.pending = exc


_active: InterruptShield | None = None


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[InterruptShield]:
    """Defer SIGINT for the duration (main thread only; elsewhere a no-op shield), then deliver it."""
    global _active
    if threading.current_thread() is not threading.main_thread():
        yield InterruptShield()  # signals are only ever handled on the main thread: nothing to defer here
        return
    if _active is not None:
        yield _active
        return
    shield = InterruptShield()
    original = signal.getsignal(signal.SIGINT)
    if original is None:  # installed outside Python: we could not restore it
        yield shield
        return
    shield._original = original
    signal.signal(signal.SIGINT, shield._handler)
    _active = shield
    try:
        yield shield
    finally:
        _active = None
        signal.signal(signal.SIGINT, original)
        if shield._redeliver:
            signal.raise_signal(signal.SIGINT)
        shield.check()


# ---------------------------------------------------------------------------------------------- exit handling

_exit_registry: weakref.WeakSet[Any] = weakref.WeakSet()
_exit_hook_installed = False


def close_at_exit(obj: Any) -> None:
    """Call `obj._close_at_exit()` at interpreter exit, before non-daemon threads are joined (weakly held).

    Objects with a `_close_priority` attribute are closed in ascending order (controllers before generators: a held
    async engine must be released before its generator can stop it)."""
    global _exit_hook_installed
    with _locks_guard:
        _exit_registry.add(obj)
        if not _exit_hook_installed:
            _exit_hook_installed = register_before_thread_join(_close_all)


def register_before_thread_join(callback: Callable[[], None]) -> bool:
    """Run `callback` at interpreter exit *before* non-daemon threads are joined (a held engine thread would block
    that join forever). CPython's `threading._register_atexit`; falls back to `atexit` (after the join)."""
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(callback)
            return True
    except RuntimeError:  # already shutting down
        return False
    atexit.register(callback)
    return True


def close_at_collection(close: Callable[[], None]) -> None:
    """`close()` from a `__del__`: nothing can be reported there, so a stuck engine thread (`EngineDiedError`, a
    `RuntimeError`) or a global already gone at interpreter teardown (`AttributeError`, `TypeError`) is ignored."""
    try:
        close()
    except (RuntimeError, AttributeError, TypeError):
        pass


def _close_all() -> None:
    objects = sorted(list(_exit_registry), key=lambda o: getattr(o, "_close_priority", 1))
    for obj in objects:
        try:
            obj._close_at_exit()
        except Exception:  # noqa: BLE001 - exit must go on for the other engines; the cause is logged
            logger.warning("Could not stop a continuous batching engine at exit.", exc_info=True)
    gc.collect()  # free engine objects while modules still exist (their __del__ needs torch and gc)
