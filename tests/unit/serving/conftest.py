"""Shared by the server tests: one torch thread in the test process (2-core machines: the other core is the server's),
sharp (std 0.2) tiny checkpoints (`checkpoint`: one per module, with the module's `EOS_LOGIT_BIAS`), and a
module-scoped `trl-cb serve` process on the module's `checkpoint` fixture, stopped at the end of the module, also on
failure."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
import uvicorn
from transformers import AutoModelForCausalLM

from trl_cb.offline.tiny import tiny_model
from trl_cb.serving.launch import local_rollout_server
from trl_cb.serving.weight_sync import free_port

#: |server logprob - local teacher-forced logprob| allowed (fp32, std-0.2 weights): fp32 noise only. The two
#: processes' matmuls are blocked differently (the server's batches depend on when requests join; the test process
#: may run 1 or 2 threads), measured up to 1.19e-5 (pinned to one core) and 1.14e-5 (AVX-512); every control
#: (old weights, perturbed weights, a recomputed prefix, the un-merged adapter) misses by 1e-4 to > 1 nat.
FP32_LOGPROB_TOL = 2e-5
#: The same fp32 noise can carry one token across a top-p or min-p cut, which moves the normaliser by that token's
#: mass, not by noise: on the tiny std-0.2 model at top-p 0.9 the cumulative mass lies within 2e-5 of the cut at 3% of
#: positions; a 0.013-nat gap failed one full-suite run (39 seeds alone: none). `cut_gaps` compares a position past
#: the tolerance again with the cut nudged by this much either way (absolute for top-p, relative for min-p).
CUT_NUDGE = 1e-4

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: `/metrics` as JSON (without the Accept header it answers Prometheus text).
METRICS_JSON = {**AUTH, "Accept": "application/json"}
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def save_sharp_checkpoint(tmp_path_factory, tokenizer, name: str, eos_logit_bias: float | None) -> str:
    """A tiny std-0.2 model (logprobs far from uniform, so a comparison can fail) and the tokenizer, saved."""
    directory = tmp_path_factory.mktemp(name)
    tiny_model(tokenizer, eos_logit_bias=eos_logit_bias, init_std=0.2).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@contextlib.contextmanager
def running_server(checkpoint: str, *extra: str):
    """A `trl-cb serve` process (one thread) on a free loopback port, up and healthy; stopped on exit. Its start is
    waited for while it progresses, however slow the machine (`launch.wait_until_serving`), not against a clock."""
    env = {"PYTHONPATH": str(ROOT)}
    with local_rollout_server(checkpoint, threads=1, extra_args=extra, env=env) as server:
        yield server.process, server.url


@pytest.fixture(scope="module")
def checkpoint(request, tmp_path_factory, tokenizer) -> str:
    """The module's sharp checkpoint, with the EOS logit bias the module sets as `EOS_LOGIT_BIAS` (none by default:
    completions run to `max_tokens`); a module that needs another model defines its own `checkpoint`."""
    name = request.module.__name__.rsplit(".", 1)[-1]
    bias = getattr(request.module, "EOS_LOGIT_BIAS", None)
    return save_sharp_checkpoint(tmp_path_factory, tokenizer, f"ckpt-{name}", eos_logit_bias=bias)


def cut_gaps(
    served: torch.Tensor, reference: Callable[[float, float], torch.Tensor], top_p: float = 1.0, min_p: float = 0.0
) -> tuple[torch.Tensor, int]:
    """Per position, |served - reference(top_p, min_p)|, where that exceeds `FP32_LOGPROB_TOL` the smallest gap to
    `reference` with the cut nudged by `CUT_NUDGE` either way; and how many positions only a nudge brings within the
    tolerance (a cut flip). Tests accept at most one per run: a processing error moves many positions, by far more
    than a nudge of 1e-4 explains, and the requests' controls still miss by > 100x the tolerance."""
    gaps = (reference(top_p, min_p) - served).abs()
    far = gaps > FP32_LOGPROB_TOL
    if not far.any() or (top_p >= 1.0 and not min_p):
        return gaps, 0
    for sign in (1.0, -1.0):
        nudged_top_p = min(top_p + sign * CUT_NUDGE, 1.0) if top_p < 1.0 else top_p
        gaps = torch.minimum(gaps, (reference(nudged_top_p, min_p * (1.0 + sign * CUT_NUDGE)) - served).abs())
    return gaps, int((far & (gaps <= FP32_LOGPROB_TOL)).sum())


def metrics(url: str) -> dict[str, Any]:
    """The server's `/metrics` as JSON."""
    return requests.get(url + "/metrics", headers=METRICS_JSON, timeout=10).json()


@pytest.fixture(scope="module")
def server(checkpoint):
    """One server per test module, on that module's `checkpoint` fixture, with the API key."""
    with running_server(checkpoint, "--api-key", KEY) as running:
        yield running


@pytest.fixture(scope="module")
def local_model(checkpoint):
    """The module's checkpoint loaded in this process (fp32, eval): the reference the server must match."""
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@contextlib.contextmanager
def in_process_server(app: Any, host: str = "127.0.0.1", port: int | None = None) -> Iterator[str]:
    """`app` on uvicorn in a thread of this process (no process start: for tests of the HTTP surface); yields its URL
    once it serves, waited for while its thread lives (no clock); stopped and its engine closed on exit."""
    port = free_port() if port is None else port
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "uvicorn exited during startup"
            time.sleep(0.02)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        app.state.engine_loop.close()
