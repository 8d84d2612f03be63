"""An engine without per-request warpers (`per_request_processors: false`) batches by settings without starving either:
groups the running engine can take pass older ones that need a rebuild, each passed at most `--max-num-seqs` times.
A real server process (`--max-num-seqs 2`) on loopback; the queue order is made exact without racing the machine: the
server is paused and each request is sent only once the previous one's group is queued (polled on `/metrics`).
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from tests.unit.serving.conftest import AUTH, KEY, metrics, running_server

A, B = 1.0, 0.7  # two temperatures: two engine settings on an engine without per-request warpers


@pytest.fixture(scope="module")
def server(checkpoint):
    config = json.dumps({"per_request_processors": False})
    with running_server(
        checkpoint, "--api-key", KEY, "--max-num-seqs", "2", "--continuous_batching_config", config
    ) as s:
        yield s


def rebuilds_for(url: str, prompt: list[int], temperatures: list[float]) -> int:
    """Engine builds while groups with `temperatures`, queued in this order behind a pause, are served (the engine
    runs temperature A when they start)."""
    body = {"prompt": [prompt], "max_tokens": 8}
    assert requests.post(url + "/v1/completions", json={**body, "temperature": A}, headers=AUTH, timeout=60).ok
    builds = metrics(url)["engine_builds"]
    assert requests.post(url + "/pause", headers=AUTH, timeout=30).ok
    threads = []
    for k, temperature in enumerate(temperatures):
        thread = threading.Thread(
            target=requests.post,
            args=(url + "/v1/completions",),
            kwargs={"json": {**body, "temperature": temperature}, "headers": AUTH, "timeout": 120},
        )
        thread.start()
        threads.append(thread)
        deadline = time.monotonic() + 60
        while metrics(url)["queue_groups"] < k + 1:  # queued before the next is sent: the order is exact
            assert time.monotonic() < deadline, "a request never reached the queue"
            time.sleep(0.02)
    assert requests.post(url + "/resume", headers=AUTH, timeout=30).ok
    for thread in threads:
        thread.join(timeout=120)
    assert metrics(url)["queue_groups"] == 0
    return metrics(url)["engine_builds"] - builds


def test_alternating_settings_batch_together(server, prompts):
    """A B A B A B behind an A engine: the As pass the Bs, then one rebuild serves every B (a rebuild per switch
    before: 5)."""
    _, url = server
    assert rebuilds_for(url, prompts[0], [A, B, A, B, A, B]) == 1


def test_a_waiting_group_is_passed_at_most_max_num_seqs_times(server, prompts):
    """B then four As behind an A engine, `--max-num-seqs 2`: two As pass B, then the engine drains and is rebuilt
    for B, then back for the last As (2 rebuilds; without the bound every A would pass B: 1)."""
    _, url = server
    assert rebuilds_for(url, prompts[0], [B, A, A, A, A]) == 2
