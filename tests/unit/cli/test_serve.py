"""`trl-cb serve`'s options: parsed and checked before any model loads; each one reaches the server it starts.

The app runs in this process on uvicorn (a thread, a free loopback port) rather than in a subprocess: the options are
what is tested, not process handling (tests/unit/serving covers that).
"""

from __future__ import annotations

from typing import Any

import pytest
import requests
import torch

from tests.unit.serving.conftest import in_process_server
from trl_cb.cli import serve
from trl_cb.serving.weight_sync import free_port

KEY = "serve-test-key"


def serving(app: Any, host: str, port: int) -> Any:
    """`app` on uvicorn in a thread at `host:port` (conftest's in-process server), stopped on exit."""
    return in_process_server(app, host, port)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("{bad json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"max_memory_percnt": 0.3}', "max_memory_percnt"),
        ('{"max_memory_percent": 3}', "max_memory_percent must be in"),
    ],
)
def test_bad_continuous_batching_config_exits_before_loading(monkeypatch, capsys, value, reason):
    def load(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded although an option was bad")

    monkeypatch.setattr(serve, "build_app", load)
    with pytest.raises(SystemExit) as info:
        serve.main(["--model", "trl-cb/tiny", "--continuous_batching_config", value])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--continuous_batching_config" in err and reason in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--dtype", "int8"],
        ["--port", "http"],
        ["--max-body-bytes", "0"],
        ["--max-body-bytes", "1MB"],
        ["--gil-switch-interval-ms", "0"],
        ["--gil-switch-interval-ms", "nan"],
    ],
)
def test_bad_options_exit_before_loading(capsys, argv):
    with pytest.raises(SystemExit) as info:
        serve.build_parser().parse_args(["--model", "trl-cb/tiny", *argv])
    assert info.value.code == 2 and argv[0] in capsys.readouterr().err


def test_defaults_are_loopback_float32_cpu_open():
    args = serve.build_parser().parse_args(["--model", "trl-cb/tiny"])
    assert (args.host, args.port, args.dtype, args.device, args.api_key) == ("127.0.0.1", 8000, "float32", "cpu", None)
    assert args.continuous_batching_config is None and args.max_body_bytes is None  # the server's default


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_options_reach_the_server(dtype):
    port = free_port()
    cb = '{"max_memory_percent": 0.3, "max_batch_tokens": 64}'
    argv = ["--model", "trl-cb/tiny", "--dtype", dtype, "--device", "cpu", "--host", "127.0.0.1", "--port", str(port)]
    extra = ["--api-key", KEY, "--continuous_batching_config", cb, "--max-body-bytes", "4096"]
    args = serve.build_parser().parse_args([*argv, *extra])
    assert args.continuous_batching_config == {"max_memory_percent": 0.3, "max_batch_tokens": 64}
    app = serve.build_app(args)
    model = app.state.engine_loop.generator.model
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    cb_kwargs = app.state.engine_loop.generator._pool.cb_kwargs
    assert cb_kwargs["max_memory_percent"] == 0.3 and cb_kwargs["max_batch_tokens"] == 64
    auth = {"Authorization": f"Bearer {KEY}"}
    with serving(app, args.host, args.port) as url:
        assert requests.get(url + "/health", timeout=5).status_code == 200  # open without the key
        assert requests.get(url + "/v1/models", timeout=5).status_code == 401
        card = requests.get(url + "/v1/models", headers=auth, timeout=5).json()["data"][0]
        assert card["id"] == "trl-cb/tiny" and card["dtype"] == dtype
        body = {"prompt": [[5, 6, 7]], "n": 2, "max_tokens": 4}
        response = requests.post(url + "/v1/completions", json=body, headers=auth, timeout=60)
        assert response.status_code == 200 and len(response.json()["choices"]) == 2
        too_large = {"prompt": [[5] * 2000], "max_tokens": 4}  # > 4096 bytes of JSON
        assert requests.post(url + "/v1/completions", json=too_large, headers=auth, timeout=60).status_code == 413


def test_the_gil_switch_interval_reaches_the_interpreter(monkeypatch):
    """`--gil-switch-interval-ms` is what `serving.server.serve` sets before uvicorn runs (restored here)."""
    import sys

    import uvicorn

    from trl_cb.serving.server import serve as run

    args = serve.build_parser().parse_args(["--model", "trl-cb/tiny", "--gil-switch-interval-ms", "0.5"])
    before, seen = sys.getswitchinterval(), []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: seen.append(sys.getswitchinterval()))
    try:
        run(object(), "127.0.0.1", free_port(), gil_switch_interval_ms=args.gil_switch_interval_ms)
        assert seen == [pytest.approx(0.0005)]
        sys.setswitchinterval(before)
        run(object(), "127.0.0.1", free_port())  # unset: the interpreter's own, untouched
        assert seen[-1] == pytest.approx(before)
    finally:
        sys.setswitchinterval(before)
