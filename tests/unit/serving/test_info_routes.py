"""The routes vLLM users look for besides generation (docs/server.md, HTTP API): `/version`, `/v1/models/{id}` (404
in OpenAI's error shape for another id), `/detokenize` (the inverse of `/tokenize`, multi-byte text included), and
`/metrics` as Prometheus text (exposition format 0.0.4, every series present) whose counters move by exactly what a
request's `usage` says, with the same values as JSON under `Accept: application/json`. The server runs in this
process (uvicorn in a thread), with an API key.
"""

from __future__ import annotations

import re

import openai
import pytest
import requests
import transformers

import trl_cb
from tests.unit.serving.conftest import AUTH, KEY, METRICS_JSON, in_process_server
from tests.unit.serving.test_openai import warm
from trl_cb.offline.tiny import tiny_model
from trl_cb.serving.server import create_app

MODEL = "tiny-info"
#: A sample line of the text format: name, optional labels, a number.
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*"'
SAMPLE = re.compile(rf"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{{{_LABEL}(?:,{_LABEL})*\}})? (-?[0-9.e+-]+|NaN|[+-]Inf)$")


@pytest.fixture(scope="module")
def url(tokenizer):
    app = create_app(tiny_model(tokenizer, eos_logit_bias=2.0), model_name=MODEL, tokenizer=tokenizer, api_key=KEY)
    with in_process_server(app) as served:
        warm(served, MODEL)  # the engine is built here, not in a test
        yield served


def prometheus(url: str) -> tuple[dict[str, float], dict[str, str], requests.Response]:
    """(samples by `name{labels}`, type by family, the response), every line checked against the format."""
    response = requests.get(url + "/metrics", headers=AUTH, timeout=10)
    samples, types = {}, {}
    for line in response.text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ")
            types[family] = kind
        elif not line.startswith("# HELP "):
            match = SAMPLE.match(line)
            assert match, f"not the exposition format: {line!r}"
            assert match.group(1) in types, f"{match.group(1)} has no # TYPE before it"
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples, types, response


def test_version_and_model_card(url):
    assert requests.get(url + "/version", headers=AUTH, timeout=10).json() == {
        "version": trl_cb.__version__,
        "transformers": transformers.__version__,
    }
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    listed = requests.get(url + "/v1/models", headers=AUTH, timeout=10).json()["data"][0]
    assert requests.get(url + f"/v1/models/{MODEL}", headers=AUTH, timeout=10).json() == listed
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("org/some-other-model")
    assert caught.value.body["code"] == "model_not_found"  # OpenAI's shape: {"error": {message, type, param, code}}
    answer = requests.get(url + "/v1/models/org/some-other-model", headers=AUTH, timeout=10)
    assert answer.status_code == 404 and set(answer.json()["error"]) == {"message", "type", "param", "code"}
    assert "some-other-model" not in answer.text  # never echoed
    assert requests.get(url + f"/v1/models/{MODEL}", timeout=10).status_code == 401  # the API key, as every route


def test_detokenize_inverts_tokenize(url, tokenizer):
    text = "Natalia sold 48 clips: Café €5 😀"
    ids = requests.post(url + "/tokenize", json={"prompt": text}, headers=AUTH, timeout=10).json()["tokens"]
    assert len(ids) > len(text.split())  # several tokens (the multi-byte characters split)
    answer = requests.post(url + "/detokenize", json={"model": MODEL, "tokens": ids}, headers=AUTH, timeout=10)
    assert answer.json() == {"prompt": text}
    assert requests.post(url + "/detokenize", json={"tokens": []}, headers=AUTH, timeout=10).json() == {"prompt": ""}
    for tokens, status in (([5, len(tokenizer)], 400), ([-1], 400), (["five"], 422), ([5.5], 422)):
        refused = requests.post(url + "/detokenize", json={"tokens": tokens}, headers=AUTH, timeout=10)
        assert refused.status_code == status, (tokens, refused.text)
    refused = requests.post(url + "/detokenize", json={"tokens": [5], "model": "other"}, headers=AUTH, timeout=10)
    assert refused.status_code == 404


def test_prometheus_metrics_count_what_requests_report(url, prompts):
    """Every series is there (HELP, TYPE, a sample each); a request moves the counters by its `usage`, a refused one
    the rejected count; the JSON (`Accept: application/json`) says the same."""
    before, types, response = prometheus(url)
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    families = {
        "trl_cb_info", "trl_cb_requests_total", "trl_cb_prompt_tokens_total", "trl_cb_generation_tokens_total",
        "trl_cb_groups_total", "trl_cb_queue_groups", "trl_cb_running_groups", "trl_cb_engine_builds_total",
        "trl_cb_paused", "trl_cb_weight_version", "trl_cb_weight_updates_in_flight_total", "trl_cb_weight_sync_open",
        "trl_cb_weight_sync_failed", "trl_cb_weight_sync_dropped_owners_total", "trl_cb_uptime_seconds",
    }  # fmt: skip
    assert set(types) == families and all(types[f] == "counter" for f in families if f.endswith("_total"))
    assert f'trl_cb_info{{model="{MODEL}",version="{trl_cb.__version__}",dtype="float32"}}' in before

    body = {"model": MODEL, "prompt": prompts[:2], "n": 3, "max_tokens": 8, "temperature": 0.9}
    usage = requests.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120).json()["usage"]
    bad = {"model": MODEL, "prompt": [[5]], "max_tokens": 0}
    assert requests.post(url + "/v1/completions", json=bad, headers=AUTH, timeout=10).status_code == 422
    after, _, _ = prometheus(url)
    moved = {name: after[name] - before[name] for name in before}
    assert moved['trl_cb_requests_total{outcome="served"}'] == 1
    assert moved['trl_cb_requests_total{outcome="rejected"}'] == 1
    assert moved["trl_cb_prompt_tokens_total"] == usage["prompt_tokens"] == sum(map(len, prompts[:2]))
    assert moved["trl_cb_generation_tokens_total"] == usage["completion_tokens"] > 0
    assert moved['trl_cb_groups_total{outcome="finished"}'] == 2  # a group per prompt
    assert after["trl_cb_queue_groups"] == after["trl_cb_running_groups"] == 0 and after["trl_cb_weight_version"] == 0
    assert after["trl_cb_uptime_seconds"] > 0

    snapshot = requests.get(url + "/metrics", headers=METRICS_JSON, timeout=10).json()
    assert snapshot["requests_served"] == after['trl_cb_requests_total{outcome="served"}']
    assert snapshot["tokens_generated"] == after["trl_cb_generation_tokens_total"]
    assert snapshot["prompt_tokens"] == after["trl_cb_prompt_tokens_total"]
    assert requests.get(url + "/metrics", timeout=10).status_code == 401  # the API key, as every route but /health
