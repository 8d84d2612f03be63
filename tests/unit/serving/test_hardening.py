"""The rollout server against a hostile client, as a real process on loopback (issue 27): one auth layer that refuses
on headers before any body is read, a body-size limit enforced while reading, validation errors that never echo input,
non-finite and sub-floor sampling values refused (422, never 500), unknown and unapplicable settings refused by the
trainer's rule, non-finite weights refused with the served weights unchanged, and weight versions strictly increasing.

No test races the machine: a server that must answer before reading a body is given no body at all (it answers, or
the test's socket times out: the failure case only), and every other check waits for an answer.
"""

from __future__ import annotations

import json
import socket

import pytest
import requests
import torch

from tests.unit.serving.conftest import AUTH, FP32_LOGPROB_TOL, KEY, running_server
from tests.unit.serving.test_server import max_gap, perturbed
from trl_cb.errors import RolloutServerError
from trl_cb.serving.client import RolloutClient
from trl_cb.serving.weight_buckets import DEFAULT_BUCKET_BYTES
from trl_cb.serving.weight_sync import WeightSender

#: The body limit the module's server runs with (`--max-body-bytes`): small, so a test crosses it cheaply.
LIMIT = 256 * 1024


#: The checkpoint's EOS logit bias (conftest's `checkpoint`): completions end early, lengths vary.
EOS_LOGIT_BIAS = 4.0


@pytest.fixture(scope="module")
def server(checkpoint):
    with running_server(checkpoint, "--api-key", KEY, "--max-body-bytes", str(LIMIT)) as running:
        yield running


def raw_exchange(url: str, head: str, body: bytes = b"", timeout: float = 30.0) -> tuple[int, bytes]:
    """Send `head` (request line and headers, without the blank line) and `body` as they are, then read the answer:
    (status, body). The declared Content-Length may exceed `body`: the rest is never sent."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        header, _, rest = data.partition(b"\r\n\r\n")
        length = next(
            (int(line.split(b":")[1]) for line in header.split(b"\r\n") if line.lower().startswith(b"content-length")),
            None,
        )
        while length is not None and len(rest) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
    return int(header.split(b" ")[1]), rest


def post_raw(url: str, text: str, headers: dict | None = None) -> requests.Response:
    """POST `text` as it is (JSON with NaN / Infinity literals, which `json=` would also write, but explicit)."""
    headers = {"Content-Type": "application/json", **(headers if headers is not None else AUTH)}
    return requests.post(url + "/v1/completions", data=text, headers=headers, timeout=30)


# ------------------------------------------------------------------------------------------------ 1-2: auth layer


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect", "/no/such/route"])
def test_every_route_but_health_needs_the_key(server, path):
    _, url = server
    assert requests.get(url + path, timeout=10).status_code == 401
    assert requests.get(url + path, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    assert requests.get(url + "/health", timeout=10).status_code == 200


def test_unauthenticated_request_is_refused_on_its_headers(server):
    """Invalid JSON without a key: 401 (not 422 with parser details); a 100 MB body announced without a key is
    answered without being sent (so without being read)."""
    _, url = server
    response = post_raw(url, "{not json", headers={})
    assert response.status_code == 401 and "json" not in response.text.lower()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {100 * 2**20}"
    )
    status, body = raw_exchange(url, head, b'{"prompt": [[5, ')
    assert status == 401 and len(body) < 500


# ------------------------------------------------------------------------------------------------ 3: body limit


def test_body_over_the_limit_is_413_before_it_is_read(server):
    _, url = server
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {100 * 2**20}"
    )
    status, body = raw_exchange(url, head, b'{"prompt": [[5, ')  # the rest never comes: answered on the header
    assert status == 413 and str(LIMIT) in body.decode()


def test_chunked_body_over_the_limit_is_413_while_reading(server):
    """No Content-Length (chunked): the limit is counted as the body arrives; the answer is short."""
    _, url = server
    prompt = json.dumps({"prompt": [[5] * (LIMIT // 3)], "max_tokens": 4}).encode()
    assert len(prompt) > LIMIT

    def chunks():
        for start in range(0, len(prompt), 8192):
            yield prompt[start : start + 8192]

    response = requests.post(
        url + "/v1/completions", data=chunks(), headers={**AUTH, "Content-Type": "application/json"}, timeout=30
    )
    assert response.status_code == 413 and len(response.content) < 500
    assert requests.get(url + "/health", timeout=10).status_code == 200


def test_validation_errors_never_echo_the_input(server):
    _, url = server
    body = {"prompt": [[5] * 40_000], "max_tokens": 4}  # under the byte limit, over MAX_PROMPT_TOKENS
    response = requests.post(url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    assert response.status_code == 422 and "prompt" in response.text
    assert len(response.content) < 2000 and "5, 5" not in response.text


# ------------------------------------------------------------------------------------------ 4-5: values, floors


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"prompt": [[5, 6]], "max_tokens": 4, "temperature": NaN}', "temperature"),
        ('{"prompt": [[5, 6]], "max_tokens": 4, "temperature": Infinity}', "temperature"),
        ('{"prompt": [[5, 6]], "max_tokens": 4, "top_p": NaN}', "top_p"),
        ('{"prompt": [[5, 6]], "max_tokens": 4, "top_p": -Infinity}', "top_p"),
        ('{"prompt": [[5, NaN]], "max_tokens": 4}', "prompt"),
        ('{"prompt": [[5, Infinity]], "max_tokens": 4}', "prompt"),
    ],
)
def test_non_finite_values_are_422_not_500(server, text, field):
    _, url = server
    response = post_raw(url, text)
    assert response.status_code == 422 and field in response.text
    assert "NaN" not in response.text and "Infinity" not in response.text
    assert requests.get(url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 1e-3, -1.0, -0.0001])
def test_temperature_below_the_floor_is_refused(server, temperature):
    """Under the floor and not 0 (greedy: tests/unit/serving/test_openai.py): 422 naming the floor."""
    _, url = server
    body = {"prompt": [[5, 6]], "max_tokens": 4, "temperature": temperature}
    response = requests.post(url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    assert response.status_code == 422 and "temperature" in response.text and "0.01" in response.text


def test_temperature_at_the_floor_samples(server, prompts):
    _, url = server
    body = {"prompt": [prompts[0]], "max_tokens": 8, "temperature": 0.01, "n": 2, "return_token_ids": True}
    response = requests.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200
    assert all(len(c["token_ids"]) > 0 for c in response.json()["choices"])


# --------------------------------------------------------------------------------------- 6: fields and settings


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"repetition_penalty": 0.0}, "repetition_penalty"),  # served, but outside its bounds
        ({"min_p": 1.5}, "min_p"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"typical_p": 0.5}, "typical_p"),  # not served
        ({"epsilon_cutoff": 0.1}, "epsilon_cutoff"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_unknown_or_unapplicable_settings_are_refused(server, extra, field):
    _, url = server
    body = {"prompt": [[5, 6]], "max_tokens": 4, **extra}
    response = requests.post(url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    assert response.status_code == 422 and field in response.text


# ------------------------------------------------------------------------------------- 7 and versions: weights


#: A tensor inside a bucket of three at `bucket_bytes=16384` (the q bias, k weight and k bias of layer 0 share one).
MIDDLE_OF_A_BUCKET = "model.layers.0.self_attn.k_proj.weight"


@pytest.mark.parametrize("bucket_bytes", [0, 16384, DEFAULT_BUCKET_BYTES])
def test_non_finite_weights_are_refused_and_the_served_weights_kept(server, local_model, prompts, bucket_bytes):
    _, url = server
    poisoned = perturbed(local_model)
    with torch.no_grad():
        poisoned.get_parameter(MIDDLE_OF_A_BUCKET).view(-1)[3] = float("nan")
    sender = WeightSender(url, api_key=KEY, timeout=30, bucket_bytes=bucket_bytes)
    try:
        with pytest.raises(RolloutServerError, match="non-finite") as info:
            sender.push(poisoned, 1)
        assert "400" in str(info.value) and MIDDLE_OF_A_BUCKET in str(info.value)  # named, whatever its bucket
        assert 1 not in sender.pushed_versions
        card = requests.get(url + "/v1/models", headers=AUTH, timeout=10).json()["data"][0]
        assert card["weight_version"] == 0
        client = RolloutClient([url], api_key=KEY, timeout=60)
        result = client.generate(prompts[:2], 2, max_tokens=8)
        assert result.weight_versions == [0] * 4
        assert max_gap(local_model, prompts[:2], result, 2) <= FP32_LOGPROB_TOL  # still the initial weights
    finally:
        sender.close()


@pytest.mark.parametrize("bucket_bytes", [0, 16384])
def test_weights_pushed_in_buckets_are_served_exactly(server, local_model, prompts, bucket_bytes):
    """A push packed in many buckets (and in none) serves exactly the trainer's weights: logprobs match a
    teacher-forced pass of the pushed model, not of the weights before."""
    _, url = server
    new_model = perturbed(local_model)
    sender = WeightSender(url, api_key=KEY, timeout=30, bucket_bytes=bucket_bytes)
    try:
        sender.push(new_model, 1)
        client = RolloutClient([url], api_key=KEY, timeout=60)
        client.known_versions |= sender.pushed_versions
        result = client.generate(prompts[:2], 2, max_tokens=8)
        assert result.weight_versions == [1] * 4
        gap, control = max_gap(new_model, prompts[:2], result, 2), max_gap(local_model, prompts[:2], result, 2)
        assert gap <= FP32_LOGPROB_TOL and control > 0.05
        sender.push(local_model, 2)  # the module's later tests expect the initial weights
    finally:
        sender.close()


def test_weight_versions_strictly_increase_per_owner(server, local_model):
    _, url = server
    sender = WeightSender(url, api_key=KEY, timeout=30)
    try:
        sender.push(local_model, 5)
        for repeat in (5, 3):  # a repeat, then a lower version: refused before any tensor is sent
            with pytest.raises(RolloutServerError, match="409"):
                sender.push(perturbed(local_model), repeat)
            assert requests.get(url + "/v1/models", headers=AUTH, timeout=10).json()["data"][0]["weight_version"] == 5
        sender.push(local_model, 6)
    finally:
        sender.close()


def test_weight_update_completion_has_its_own_endpoint(server, local_model):
    """The trainer learns that a version is in place from `/weights/wait` (not from `/metrics` keys); a version never
    announced is an error there, not a wait."""
    _, url = server
    sender = WeightSender(url, api_key=KEY, timeout=30)
    try:
        sender.push(local_model, 1)
        answer = requests.post(
            url + "/weights/wait", json={"token": sender._token, "version": 1}, headers=AUTH, timeout=30
        )
        assert answer.status_code == 200 and answer.json()["weight_version"] == 1
        never = requests.post(
            url + "/weights/wait", json={"token": sender._token, "version": 7}, headers=AUTH, timeout=30
        )
        assert never.status_code == 404
    finally:
        sender.close()


# ------------------------------------------------------------------------ the OpenAI-compatible routes (issue 42)

CHAT = {"messages": [{"role": "user", "content": "How many clips?"}], "max_tokens": 4}
COMPLETIONS, CHAT_PATH, TOKENS_PATH = "/v1/completions", "/v1/chat/completions", "/v1/chat/completions/tokens"
RESPONSES = "/v1/responses"


@pytest.mark.parametrize("path", [CHAT_PATH, TOKENS_PATH, "/tokenize", RESPONSES])
def test_openai_routes_refuse_on_headers(server, path):
    """Auth before the body (invalid JSON without a key: 401; 100 MB announced: 401 without the key, 413 with it),
    as on every other route."""
    _, url = server
    response = requests.post(url + path, data="{not json", headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 401 and "json" not in response.text.lower()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {100 * 2**20}"
    assert raw_exchange(url, head, b'{"messages": [')[0] == 401
    status, body = raw_exchange(url, head + f"\r\nAuthorization: Bearer {KEY}", b'{"messages": [')
    assert status == 413 and len(body) < 500


@pytest.mark.parametrize(
    ("path", "body", "status", "field"),
    [
        (CHAT_PATH, {"messages": [], "max_tokens": 4}, 422, "messages"),
        (CHAT_PATH, {"messages": [{"role": "wizard", "content": "x"}]}, 422, "role"),
        (
            CHAT_PATH,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            422,
            "content",
        ),
        (CHAT_PATH, {**CHAT, "tool_choice": "required"}, 422, "tool_choice"),
        (CHAT_PATH, {**CHAT, "logprobs": True, "top_logprobs": 21}, 422, "top_logprobs"),
        (CHAT_PATH, {**CHAT, "top_logprobs": 3}, 422, "top_logprobs"),  # without logprobs: true
        (CHAT_PATH, {**CHAT, "seed": -2}, 422, "seed"),
        (CHAT_PATH, {**CHAT, "presence_penalty": 2.5}, 422, "presence_penalty"),
        (CHAT_PATH, {**CHAT, "logit_bias": {"5": 300.0}}, 422, "logit_bias"),
        (CHAT_PATH, {**CHAT, "response_format": {"type": "json_object"}}, 422, "response_format"),
        (CHAT_PATH, {**CHAT, "stop": ["x"] * 17}, 422, "stop"),
        (CHAT_PATH, {**CHAT, "min_p": -0.1}, 422, "min_p"),
        (CHAT_PATH, {**CHAT, "model": "gpt-4o"}, 404, "model"),
        (TOKENS_PATH, {"tokens": [5, 10**7], "max_tokens": 4}, 400, "vocabulary"),
        (TOKENS_PATH, {"tokens": [5, 10**7], "max_tokens": 4, "stream": True}, 400, "vocabulary"),
        (COMPLETIONS, {"prompt": "hi", "logprobs": 3, "stream": True}, 422, "logprobs"),
        (COMPLETIONS, {"prompt": "hi", "best_of": 2}, 422, "best_of"),
        (COMPLETIONS, {"prompt": "hi", "suffix": "x"}, 422, "suffix"),
        (COMPLETIONS, {"prompt": "hi", "stream_options": {"include_usage": True}}, 422, "stream_options"),
        (COMPLETIONS, {"prompt": [[5, 6]], "encoding": "binary", "stream": True}, 422, "encoding"),
        (COMPLETIONS, {"prompt": "hi", "detokenize": False, "stop": "x"}, 422, "stop"),
        (COMPLETIONS, {"prompt": [[5, 10**7]], "stream": True}, 400, "vocabulary"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 422, "exactly one"),
        (RESPONSES, {"input": "hi", "top_logprobs": 2}, 422, "top_logprobs"),
        (RESPONSES, {"input": "hi", "n": 2}, 422, "n must be 1"),
        (
            RESPONSES,
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            422,
            "input",
        ),
        (RESPONSES, {"input": "hi", "model": "gpt-4o"}, 404, "model"),
    ],
)
def test_openai_requests_the_server_cannot_honour_are_refused(server, path, body, status, field):
    """Refused with 4xx naming the field (a stream too: before its first event), never ignored, never echoed (the
    prompt checks name the one id outside the vocabulary, as on trl_cb's own routes)."""
    _, url = server
    response = requests.post(url + path, json=body, headers=AUTH, timeout=30)
    assert response.status_code == status and field in response.text and len(response.content) < 2000
    assert "gpt-4o" not in response.text
    assert requests.get(url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("path", "text", "field"),
    [
        (CHAT_PATH, '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature"),
        (CHAT_PATH, '{"messages": [{"role": "user", "content": "x", "weight": Infinity}]}', "messages"),
        (CHAT_PATH, '{"messages": [{"role": "user", "content": "x"}], "tools": [{"x": NaN}]}', "tools"),
        (TOKENS_PATH, '{"tokens": [5, NaN], "max_tokens": 4}', "tokens"),
        (COMPLETIONS, '{"prompt": "x", "top_p": -Infinity}', "top_p"),
        ("/tokenize", '{"messages": [{"role": "user", "content": "x"}], "tools": [{"x": NaN}]}', "tools"),
        (RESPONSES, '{"input": "x", "top_p": NaN}', "top_p"),
        (RESPONSES, '{"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"x": NaN}}]}', "tools"),
    ],
)
def test_openai_non_finite_values_are_422(server, path, text, field):
    _, url = server
    headers = {"Content-Type": "application/json", **AUTH}
    response = requests.post(url + path, data=text, headers=headers, timeout=30)
    assert response.status_code == 422 and field in response.text
    assert "NaN" not in response.text and "Infinity" not in response.text


def test_openai_long_token_prompt_is_refused_without_echo(server):
    _, url = server
    response = requests.post(url + TOKENS_PATH, json={"tokens": [5] * 40_000}, headers=AUTH, timeout=30)
    assert response.status_code == 422 and "tokens" in response.text
    assert len(response.content) < 2000 and "5, 5" not in response.text


def test_openai_text_routes_answer_on_the_served_tokenizer(server, tokenizer):
    """The CLI loads the checkpoint's tokenizer: a text prompt and a chat both answer, with text."""
    _, url = server
    body = {"prompt": "Natalia sold", "max_tokens": 4, "return_token_ids": True}
    choice = requests.post(url + COMPLETIONS, json=body, headers=AUTH, timeout=60).json()["choices"][0]
    assert choice["prompt_token_ids"] == tokenizer.encode("Natalia sold") and isinstance(choice["text"], str)
    answer = requests.post(url + CHAT_PATH, json=CHAT, headers=AUTH, timeout=60).json()
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["role"] == "assistant"
    body = {"input": "How many clips?", "max_output_tokens": 4}
    response = requests.post(url + RESPONSES, json=body, headers=AUTH, timeout=60).json()
    assert response["object"] == "response" and response["output"][0]["content"][0]["type"] == "output_text"
