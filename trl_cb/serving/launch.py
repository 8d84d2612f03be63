"""Start a `trl-cb serve` replica as a child process on this machine, for scripts and benchmarks that want a rollout
server without managing one (`local_rollout_server`).

Invariants: the server listens on a free loopback port; the context yields only once `/health` answers; on exit,
also on errors and Ctrl-C, the child is interrupted (it exits within ~1 s: `cli/serve.py`), then killed if it lingers.
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
    port = free_port()
    child_env = {**os.environ, **(env or {})}
    command = [sys.executable, "-m", "trl_cb.cli", "serve", "--model", model, "--port", str(port), *extra_args]
    if threads:
        command += ["--threads", str(threads)]
        child_env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.Popen(command, env=child_env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RolloutServerError(f"trl-cb serve exited with code {proc.returncode} during startup")
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RolloutServerError(f"trl-cb serve did not answer /health within {startup_timeout} s")
            time.sleep(0.2)
        yield LocalServer(url, proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
