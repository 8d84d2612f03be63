"""Start a `trl-cb serve` replica as a child process on this machine, for scripts and benchmarks that want a rollout
server without managing one (`local_rollout_server`).

Invariants: the server listens on a free loopback port; the context yields only once `/health` answers from this
child (its pid: never another server that took the port); a port taken between choosing and binding it is retried
on a new port (`_STARTS`); on exit, also on errors and Ctrl-C, the child is interrupted (it exits within ~1 s:
`cli/serve.py`), then killed if it lingers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import requests

from ..errors import RolloutServerError
from .weight_sync import free_port

__all__ = ["LocalServer", "local_rollout_server"]

#: Start attempts: a free port can be taken by another process before the child binds it (seen in a benchmark run
#: beside the test suite); uvicorn then exits with `_BIND_FAILED` and the child is started again on another port.
_STARTS = 5
#: uvicorn's exit code when startup fails (a port it cannot bind); a failure before uvicorn starts (a bad model) is
#: not retried.
_BIND_FAILED = 3


@dataclass(frozen=True)
class LocalServer:
    url: str
    process: subprocess.Popen[bytes]


@contextlib.contextmanager
def local_rollout_server(
    model: str,
    threads: int | None = None,
    extra_args: Sequence[str] = (),
    startup_timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> Iterator[LocalServer]:
    """Run `trl-cb serve --model MODEL` on a free loopback port and yield it (`.url`, `.process`).

    Args:
        model: What `--model` takes (a checkpoint directory, a hub name, `trl-cb/tiny`).
        threads: The server's torch threads (`--threads`, and `OMP_NUM_THREADS` for its OpenMP pool).
        extra_args: More `trl-cb serve` flags (e.g. `["--api-key", KEY]`).
        env: Extra environment variables for the child.
    """
    child_env = {**os.environ, **(env or {})}
    if threads:
        child_env["OMP_NUM_THREADS"] = str(threads)
    deadline = time.monotonic() + startup_timeout
    for attempt in range(1, _STARTS + 1):
        port = free_port()
        command = [sys.executable, "-m", "trl_cb.cli", "serve", "--model", model, "--port", str(port), *extra_args]
        if threads:
            command += ["--threads", str(threads)]
        proc = subprocess.Popen(command, env=child_env)
        url = f"http://127.0.0.1:{port}"
        try:
            if _wait_until_up(proc, url, deadline, startup_timeout):
                break
        except BaseException:
            _shut_down(proc)
            raise
        if attempt == _STARTS or proc.returncode != _BIND_FAILED:
            raise RolloutServerError(f"trl-cb serve exited with code {proc.returncode} during startup")
    try:
        yield LocalServer(url, proc)
    finally:
        _shut_down(proc)


def _wait_until_up(proc: subprocess.Popen[bytes], url: str, deadline: float, startup_timeout: float) -> bool:
    """True once `/health` answers from `proc` itself; False if `proc` exited during startup (e.g. its port was
    taken); `RolloutServerError` past `deadline`."""
    while True:
        if proc.poll() is not None:
            return False
        try:
            answer = requests.get(url + "/health", timeout=1)
            if answer.status_code == 200 and answer.json().get("pid") == proc.pid:
                return True
        except (requests.RequestException, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RolloutServerError(f"trl-cb serve did not answer /health within {startup_timeout} s")
        time.sleep(0.2)


def _shut_down(proc: subprocess.Popen[bytes]) -> None:
    """Interrupt the child (it exits within ~1 s), kill it if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
