"""Requests with different temperature / top_k / top_p share one running engine (transformers' per-request
processors), and each request's logprobs are exactly those of its own settings: the processed logprob against a
teacher-forced pass with that request's warpers, the policy logprob against `log_softmax(logits / T)` with that
request's temperature. A real server process on loopback, tiny std-0.2 model (fp32, one thread).

The requests are made to share the batch without racing the machine: the server is paused, every request is queued
(polled on `/metrics` until all its groups wait), then resumed, so one scheduling pass admits them all together.
"""

from __future__ import annotations

import threading
import time
from functools import partial

import requests
import torch

from tests.unit.rollouts.test_generator import teacher_forced_logprobs
from tests.unit.serving.conftest import (
    AUTH,
    FP32_LOGPROB_TOL,
    cut_gaps,
    metrics,
)

#: (temperature, top_k, top_p) per request; two temperatures at least, and truncation next to none.
SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 20, 0.9), (1.3, 5, 1.0)]


def test_mixed_settings_share_one_engine_with_exact_logprobs(server, local_model, prompts):
    _, url = server
    # Warm-up: the engine gets every warper (it adds one the first time a request needs it) and this budget.
    warm = {"prompt": [prompts[0]], "max_tokens": 16, "temperature": 0.9, "top_k": 30, "top_p": 0.95}
    assert requests.post(url + "/v1/completions", json=warm, headers=AUTH, timeout=60).status_code == 200
    builds = metrics(url)["engine_builds"]

    assert requests.post(url + "/pause", headers=AUTH, timeout=30).status_code == 200
    answers: dict[int, dict] = {}

    def ask(i: int, temperature: float, top_k: int, top_p: float) -> None:
        body = {"prompt": prompts[i : i + 2], "n": 2, "max_tokens": 16, "logprobs": 0, "return_token_ids": True}
        body.update(temperature=temperature, top_k=top_k, top_p=top_p)
        answers[i] = requests.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120).json()

    threads = [threading.Thread(target=ask, args=(i, *s)) for i, s in enumerate(SETTINGS)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while metrics(url)["queue_groups"] < 2 * len(SETTINGS):  # every group queued behind the pause
        assert time.monotonic() < deadline, "requests never reached the server's queue"
        time.sleep(0.02)
    assert requests.post(url + "/resume", headers=AUTH, timeout=30).status_code == 200
    for thread in threads:
        thread.join(timeout=120)

    assert metrics(url)["engine_builds"] == builds, "a change of sampling settings rebuilt the engine"
    gaps, policy_gaps, controls, flips = [], [], [], 0
    for i, (temperature, top_k, top_p) in enumerate(SETTINGS):
        request_controls = []
        for choice in answers[i]["choices"]:
            prompt, ids = prompts[i + choice["index"] // 2], choice["token_ids"]  # OpenAI's index: prompt * n + k
            own = partial(teacher_forced_logprobs, local_model, prompt, ids, temperature, top_k)
            policy = teacher_forced_logprobs(local_model, prompt, ids, temperature, 0, 1.0)
            gap, flipped = cut_gaps(
                torch.tensor(choice["logprobs"]["token_logprobs"]), lambda p, _, own=own: own(p), top_p
            )
            gaps.append(gap.max().item())
            flips += flipped
            policy_gaps.append((policy - torch.tensor(choice["policy_logprobs"])).abs().max().item())
            if temperature != 1.0:  # another request's settings would not match
                plain = teacher_forced_logprobs(local_model, prompt, ids, 1.0, 0, 1.0)
                served = torch.tensor(choice["logprobs"]["token_logprobs"])
                request_controls.append((plain - served).abs().max().item())
        # Per request: would its check catch another request's settings? Per request, not per choice: the samples
        # are unseeded, and one choice whose tokens all sit where T hardly matters can differ by < 0.05 (seen once).
        if request_controls:
            controls.append(max(request_controls))
    print(
        f"\nprocessed max|d|={max(gaps):.2e} ({flips} cut flips), policy max|d|={max(policy_gaps):.2e}; "
        f"T=1 control {min(controls):.3f}"
    )
    assert max(gaps) <= FP32_LOGPROB_TOL and max(policy_gaps) <= FP32_LOGPROB_TOL and min(controls) > 0.05
    assert flips <= 1
