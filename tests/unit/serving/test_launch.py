"""The server launcher waits while its child progresses, never against a fixed clock (`serving/launch.py`): a child
that exits fails the wait at once with its log's tail, a hung one fails after `stall_timeout` without progress, and a
slow one that keeps progressing is waited for well past `stall_timeout`. Children here are small Python scripts (no
torch import), except one real `trl-cb serve` with a model path that does not exist."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from trl_cb.errors import RolloutServerError
from trl_cb.serving.launch import local_rollout_server, shut_down, wait_until_serving
from trl_cb.serving.weight_sync import free_port

#: A child that logs a line every 50 ms for `SLOW_S` seconds, then answers `/health` with its pid.
SLOW_CHILD = """
import http.server, json, os, sys, time
port, slow_s = int(sys.argv[1]), float(sys.argv[2])
start = time.monotonic()
while time.monotonic() - start < slow_s:
    print("still loading", flush=True)
    time.sleep(0.05)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ok", "pid": os.getpid()}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _child(script: str, log_path, *args: str) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-c", script, *args], stdout=log, stderr=subprocess.STDOUT)


def test_a_child_that_exits_ends_the_wait_at_once(tmp_path):
    """No limit could run out here (stall 1 h, no deadline): only the exit itself ends the wait."""
    log = tmp_path / "child.log"
    proc = _child("import sys; print('model not found: /nowhere', flush=True); sys.exit(7)", log)
    try:
        assert wait_until_serving(proc, f"http://127.0.0.1:{free_port()}", str(log), stall_timeout=3600) is False
        assert proc.returncode == 7
    finally:
        shut_down(proc)


def test_a_hung_child_fails_after_stall_timeout_with_its_log_tail(tmp_path):
    """A child that sleeps uses no CPU and logs nothing: the wait fails once `stall_timeout` passes without
    progress, quoting what it logged; a sleeping child never progresses, however fast the machine."""
    log = tmp_path / "child.log"
    proc = _child("import time; print('loading weights', flush=True); time.sleep(3600)", log)
    try:
        with pytest.raises(RolloutServerError, match="made no progress") as info:
            wait_until_serving(proc, f"http://127.0.0.1:{free_port()}", str(log), stall_timeout=1.0)
        assert "loading weights" in str(info.value) and proc.poll() is None
    finally:
        shut_down(proc)


def test_a_slow_child_that_progresses_is_waited_for_past_stall_timeout(tmp_path):
    """The child takes 4x `stall_timeout` to answer but logs all along: the wait goes on and returns True. Control:
    the same child with a deadline shorter than its start fails (a fixed clock would have failed it)."""
    log, port, stall = tmp_path / "child.log", free_port(), 0.5
    proc = _child(SLOW_CHILD, log, str(port), str(4 * stall))
    try:
        start = time.monotonic()
        assert wait_until_serving(proc, f"http://127.0.0.1:{port}", str(log), stall_timeout=stall) is True
        assert time.monotonic() - start > 4 * stall  # it did wait past the stall limit: progress kept it going
    finally:
        shut_down(proc)
    port = free_port()
    proc = _child(SLOW_CHILD, log, str(port), "3600")
    try:
        with pytest.raises(RolloutServerError, match="startup_timeout"):
            wait_until_serving(proc, f"http://127.0.0.1:{port}", str(log), stall, deadline=time.monotonic() + 1)
    finally:
        shut_down(proc)


def test_local_rollout_server_reports_a_failed_start_with_the_servers_own_error(tmp_path):
    """A real `trl-cb serve` that cannot load its model exits during startup: the error names the exit code and
    quotes the server's own message, at once (the child's exit ends the wait)."""
    missing = str(tmp_path / "no-such-checkpoint")
    with pytest.raises(RolloutServerError, match="exited with code 1 during startup") as info:
        with local_rollout_server(missing, threads=1, log_path=str(tmp_path / "serve.log")):
            pass
    assert "no-such-checkpoint" in str(info.value) and "serve.log" in str(info.value)
