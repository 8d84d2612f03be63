"""Start a `trl-cb serve` replica as a child process on this machine, for scripts and benchmarks that want a rollout
server without managing one (`local_rollout_server`), and wait for a server child without racing the machine
(`wait_until_serving`, also used for other server children).

Why waiting is not a fixed timeout: a server's start-up (importing torch, loading and checking the model) takes 5 s on
a quiet machine and minutes beside busy processes; a fixed limit either fails on a loaded machine or waits minutes for
a child that died at once. So the wait goes on while the child is alive *and progressing* (it used CPU time or wrote
to its log since the last look), fails at once when it exits (its log's tail in the error), and fails when it has
shown no progress for `stall_timeout` seconds (a hung child); `startup_timeout` optionally bounds the whole wait.

Invariants: the server listens on a free loopback port; the context yields only once `/health` answers from this
child (its pid: never another server that took the port); a port taken between choosing and binding it is retried
on a new port (`_STARTS`); on exit, also on errors and Ctrl-C, the child is interrupted (it exits within ~1 s:
`cli/serve.py`), then killed if it lingers. The child's stdout and stderr go to a log file (`LocalServer.log_path`),
removed on a clean exit unless the caller named it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil  # accelerate's dependency too
import requests

from ..errors import RolloutServerError
from .weight_sync import free_port

__all__ = ["DEFAULT_STALL_TIMEOUT", "LocalServer", "local_rollout_server", "log_tail", "wait_until_serving"]

#: Start attempts: a free port can be taken by another process before the child binds it (seen in a benchmark run
#: beside the test suite); uvicorn then exits with `_BIND_FAILED` and the child is started again on another port.
_STARTS = 5
#: uvicorn's exit code when startup fails (a port it cannot bind); a failure before uvicorn starts (a bad model) is
#: not retried.
_BIND_FAILED = 3
#: Seconds a starting child may show no progress (no CPU time used, nothing written to its log) before it counts as
#: hung. A live process that is merely slow (a loaded machine) uses some CPU time every few seconds.
DEFAULT_STALL_TIMEOUT = 120.0
#: How often the wait looks at the child.
_POLL_S = 0.2
#: How much of the child's log an error quotes.
_TAIL_LINES = 30


@dataclass(frozen=True)
class LocalServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: str


@contextlib.contextmanager
def local_rollout_server(
    model: str,
    threads: int | None = None,
    extra_args: Sequence[str] = (),
    startup_timeout: float | None = None,
    env: dict[str, str] | None = None,
    stall_timeout: float = DEFAULT_STALL_TIMEOUT,
    log_path: str | None = None,
) -> Iterator[LocalServer]:
    """Run `trl-cb serve --model MODEL` on a free loopback port and yield it (`.url`, `.process`, `.log_path`).

    Args:
        model: What `--model` takes (a checkpoint directory, a hub name, `trl-cb/tiny`).
        threads: The server's torch threads (`--threads`, and `OMP_NUM_THREADS` for its OpenMP pool).
        extra_args: More `trl-cb serve` flags (e.g. `["--api-key", KEY]`).
        startup_timeout: Longest whole wait for `/health`, in seconds (`None`: no limit while the child progresses).
        env: Extra environment variables for the child.
        stall_timeout: Seconds without any sign of progress after which a starting child counts as hung.
        log_path: Where the child's stdout and stderr go (kept); default a temporary file, removed on a clean exit.
    """
    child_env = {**os.environ, **(env or {})}
    if threads:
        child_env["OMP_NUM_THREADS"] = str(threads)
    keep_log = log_path is not None
    if log_path is None:
        handle, log_path = tempfile.mkstemp(prefix="trl-cb-serve-", suffix=".log")
        os.close(handle)
    deadline = None if startup_timeout is None else time.monotonic() + startup_timeout
    for attempt in range(1, _STARTS + 1):
        port = free_port()
        command = [sys.executable, "-m", "trl_cb.cli", "serve", "--model", model, "--port", str(port), *extra_args]
        if threads:
            command += ["--threads", str(threads)]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(command, env=child_env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            if wait_until_serving(proc, url, log_path, stall_timeout, deadline):
                break
        except BaseException:
            shut_down(proc)
            raise
        if attempt == _STARTS or proc.returncode != _BIND_FAILED:
            raise RolloutServerError(
                f"trl-cb serve exited with code {proc.returncode} during startup; {log_tail(log_path)}"
            )
    clean = False
    try:
        yield LocalServer(url, proc, log_path)
        clean = True
    finally:
        shut_down(proc)
        if clean and not keep_log:
            with contextlib.suppress(OSError):
                os.remove(log_path)


def wait_until_serving(
    proc: subprocess.Popen[bytes],
    url: str,
    log_path: str | None,
    stall_timeout: float = DEFAULT_STALL_TIMEOUT,
    deadline: float | None = None,
) -> bool:
    """True once `/health` answers 200 from `proc` itself (its `pid`); False as soon as `proc` exits (e.g. its port
    was taken: the caller reads `proc.returncode`). `RolloutServerError`, quoting the log's tail, when `proc` showed
    no progress (CPU time, log growth) for `stall_timeout` s, or past `deadline` (`time.monotonic()`; None: none)."""
    watch = _Progress(proc.pid, log_path)
    while True:
        if proc.poll() is not None:
            return False
        try:
            answer = requests.get(url + "/health", timeout=1)
            if answer.status_code == 200 and answer.json().get("pid") == proc.pid:
                return True
        except (requests.RequestException, ValueError):
            pass
        now = time.monotonic()
        idle = watch.idle_for(now)
        if idle > stall_timeout:
            raise RolloutServerError(
                f"trl-cb serve (pid {proc.pid}) made no progress for {idle:.0f} s while starting (no CPU time used, "
                f"nothing logged; stall_timeout={stall_timeout} s); {log_tail(log_path)}"
            )
        if deadline is not None and now > deadline:
            raise RolloutServerError(
                f"trl-cb serve (pid {proc.pid}) did not answer /health within startup_timeout; {log_tail(log_path)}"
            )
        time.sleep(_POLL_S)


class _Progress:
    """When a child last showed progress: its CPU time (user + system) or its log's size changed."""

    def __init__(self, pid: int, log_path: str | None) -> None:
        self._pid, self._log_path = pid, log_path
        self._seen = self._sample()
        self._since = time.monotonic()

    def idle_for(self, now: float) -> float:
        sample = self._sample()
        if sample != self._seen:
            self._seen, self._since = sample, now
        return now - self._since

    def _sample(self) -> tuple[float, int]:
        try:
            times = psutil.Process(self._pid).cpu_times()
            cpu = times.user + times.system
        except psutil.Error:  # exited (the caller sees it next) or not visible: no CPU signal
            cpu = 0.0
        size = -1
        if self._log_path is not None:
            with contextlib.suppress(OSError):
                size = os.path.getsize(self._log_path)
        return cpu, size


def log_tail(log_path: str | None, lines: int = _TAIL_LINES) -> str:
    """'its log (PATH) ends with: ...' quoting the last `lines` lines, for an error message."""
    if log_path is None:
        return "its output was not captured"
    try:
        text = Path(log_path).read_bytes()[-16384:].decode("utf-8", errors="replace")
    except OSError as exc:
        return f"its log {log_path} could not be read ({exc})"
    tail = "\n".join(text.splitlines()[-lines:]).strip()
    return f"its log ({log_path}) ends with:\n{tail}" if tail else f"its log ({log_path}) is empty"


def shut_down(proc: subprocess.Popen[bytes]) -> None:
    """Interrupt the child (it exits within ~1 s), kill it if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
