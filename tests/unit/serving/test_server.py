"""The rollout server as a real process on loopback: API, exact logprobs, weight sync, bad requests, auth, failover.

One server (tiny std-0.2 model, fp32, one thread) serves the whole module; tests run in file order and the last one
kills it. Every process started here is stopped in the fixture's `finally`.
"""

from __future__ import annotations

import copy
import signal
import socket
import threading
import time

import pytest
import requests
import torch

from tests.unit.rollouts.test_generator import teacher_forced_logprobs
from tests.unit.serving.conftest import (
    AUTH,
    FP32_LOGPROB_TOL,
    KEY,
    METRICS_JSON,
    running_server,
)
from tests.unit.trainers.test_trainers import make_trainer
from trl_cb.engine.weight_export import iter_weights, weight_specs
from trl_cb.errors import RolloutServerError
from trl_cb.serving.client import RolloutClient
from trl_cb.serving.weight_sync import WeightSender, free_port, push_weights

#: The checkpoint's EOS logit bias (conftest's `checkpoint`): completions end early, lengths vary.
EOS_LOGIT_BIAS = 4.0


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    copy = type(model)(model.config).eval()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for param in copy.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return copy


def max_gap(model, prompts, result, n) -> float:
    result, gaps = result.as_lists(), []
    for i, (ids, logprobs) in enumerate(zip(result.completion_ids, result.logprobs)):
        ref = teacher_forced_logprobs(model, prompts[i // n], ids, 1.0, 0, 1.0)
        gaps.append((ref - torch.tensor(logprobs)).abs().max().item())
    return max(gaps)


def test_health_models_metrics(server):
    _, url = server
    assert requests.get(url + "/health", timeout=5).json()["status"] == "ok"
    card = requests.get(url + "/v1/models", headers=AUTH, timeout=5).json()["data"][0]
    assert card["weight_version"] == 0 and card["dtype"] == "float32"
    metrics = requests.get(url + "/metrics", headers=METRICS_JSON, timeout=5).json()
    assert {"requests_served", "tokens_generated", "weight_version"} <= set(metrics)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_api_key_required(server, headers):
    _, url = server
    for path in ("/v1/models", "/metrics"):
        assert requests.get(url + path, headers=headers, timeout=5).status_code == 401
    body = {"prompt": [[5, 6]], "max_tokens": 2}
    assert requests.post(url + "/v1/completions", json=body, headers=headers, timeout=5).status_code == 401
    assert requests.post(url + "/weights/update", json={}, headers=headers, timeout=5).status_code == 401


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        ({"prompt": [[5, 6]], "max_tokens": 0}, 422, "max_tokens"),
        ({"prompt": [[5, 6]], "max_tokens": 4, "echo": True, "stream": True}, 422, "echo"),
        ({"prompt": [[5, 6]], "max_tokens": 10**6}, 422, "max_tokens"),
        ({"prompt": [[5, 6]] * 5000, "max_tokens": 4}, 422, "prompt"),
        ({"prompt": [[5] * 40_000], "max_tokens": 4}, 422, "prompt"),
        ({"prompt": [[5, 10**7]], "max_tokens": 4}, 400, "outside the model's vocabulary"),
        ({"prompt": [[]], "max_tokens": 4}, 400, "empty"),
        ({"prompt": [[5, 6]], "max_tokens": 4, "n": 0}, 422, "n"),
    ],
)
def test_bad_requests_are_refused_and_server_stays_healthy(server, body, status, reason):
    _, url = server
    response = requests.post(url + "/v1/completions", json=body, headers=AUTH, timeout=10)
    assert response.status_code == status
    assert reason in response.text
    assert requests.get(url + "/health", timeout=5).status_code == 200


def test_weight_update_needs_the_init_token(server):
    _, url = server
    body = {"token": "not-the-token", "version": 1, "params": []}
    assert requests.post(url + "/weights/update", json=body, headers=AUTH, timeout=5).status_code == 403


def test_logprobs_match_teacher_forcing_then_weight_sync(server, local_model, prompts):
    _, url = server
    client = RolloutClient([url], api_key=KEY, timeout=60)
    n, short = 2, prompts[:3]
    result = client.generate(short, n, max_tokens=16).as_lists()
    assert len(result.completion_ids) == len(short) * n and result.weight_versions == [0] * len(short) * n
    assert result.policy_logprobs == result.logprobs  # nothing but temperature 1 shapes the distribution
    gap = max_gap(local_model, short, result, n)
    new_model = perturbed(local_model)
    control = max_gap(new_model, short, result, n)
    print(f"\nserver vs teacher-forced max|d|={gap:.2e}; perturbed control {control:.3f}")
    assert gap <= FP32_LOGPROB_TOL and control > 0.05

    sender = WeightSender(url, api_key=KEY, timeout=30)
    start = time.monotonic()
    sender.push(new_model, 1)
    print(f"push (init + broadcast + apply): {time.monotonic() - start:.2f} s")
    assert requests.get(url + "/v1/models", headers=AUTH, timeout=5).json()["data"][0]["weight_version"] == 1
    with pytest.raises(RolloutServerError, match="never pushed"):  # the client was not told about version 1
        client.generate(short, n, max_tokens=16)
    client.known_versions |= sender.pushed_versions
    result = client.generate(short, n, max_tokens=16)
    assert result.weight_versions == [1] * len(short) * n
    gap, control = max_gap(new_model, short, result, n), max_gap(local_model, short, result, n)
    print(f"after push: max|d|={gap:.2e}; old-weights control {control:.3f}")
    assert gap <= FP32_LOGPROB_TOL and control > 0.05
    metrics = requests.get(url + "/metrics", headers=METRICS_JSON, timeout=5).json()
    assert metrics["weight_version"] == 1 and metrics["requests_served"] >= 2 and metrics["tokens_generated"] > 0
    sender.close()


def test_lora_push_serves_the_merged_weights(server, local_model, prompts):
    """A LoRA (B non-zero) trainer pushes merged weights under the base names; the server then samples from the
    merged model, and not from the base the adapter sits on."""
    peft = pytest.importorskip("peft")
    _, url = server
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = peft.get_peft_model(copy.deepcopy(local_model), config).eval()
    plain = peft_model.get_base_model()
    sender = WeightSender(url, api_key=KEY, timeout=30)
    try:
        dtypes = [sender.server_dtype()]
        assert dtypes == [torch.float32]
        push_weights([sender], weight_specs(plain), iter_weights(plain), 2, dtypes)  # the server is at 1
        client = RolloutClient([url], api_key=KEY, timeout=60)
        client.known_versions |= sender.pushed_versions
        n, short = 2, prompts[:3]
        result = client.generate(short, n, max_tokens=16)
        merged = copy.deepcopy(peft_model).merge_and_unload()
        gap, adapter_gap = max_gap(merged, short, result, n), max_gap(peft_model, short, result, n)
        with peft_model.disable_adapter():
            control = max_gap(peft_model, short, result, n)
        print(f"\nLoRA push: merged max|d|={gap:.2e}, LoRA forward {adapter_gap:.2e}; base control {control:.3f}")
        # The merged model is what the server holds (same weights: fp32 noise only); the un-merged LoRA forward adds
        # B(Ax) separately, so it differs from the merged one by float rounding only.
        assert gap <= FP32_LOGPROB_TOL and adapter_gap <= 1e-4 and control > 0.05

        # Cast on the trainer to the announced dtype (here bf16 into the fp32 server): it serves the rounded weights.
        push_weights([sender], weight_specs(plain), iter_weights(plain), 3, [torch.bfloat16])
        client.known_versions |= sender.pushed_versions
        result = client.generate(short, n, max_tokens=16)
        rounded = copy.deepcopy(merged)
        with torch.no_grad():
            for param in rounded.parameters():
                param.copy_(param.to(torch.bfloat16).float())
        gap, control = max_gap(rounded, short, result, n), max_gap(merged, short, result, n)
        print(f"bf16 push: rounded max|d|={gap:.2e}; unrounded control {control:.2e}")
        assert gap <= FP32_LOGPROB_TOL and control > 1e-4
    finally:  # a failed check must not leave the group open for the tests after it
        sender.close()


#: Sampling settings the trainer sends its servers, beside the defaults: TRL's own and OpenAI's (`generation_kwargs`).
PENALISED = {"repetition_penalty": 1.2, "min_p": 0.05, "generation_kwargs": {"presence_penalty": 0.5}}


@pytest.mark.parametrize(("kind", "settings"), [("grpo", {}), ("rloo", {}), ("grpo", PENALISED)],
                         ids=["grpo", "rloo", "grpo-penalised"])  # fmt: skip
def test_trainer_trains_on_server_rollouts(server, tokenizer, tmp_path, kind, settings):
    """Two steps on a server's rollouts, one weight push each; the trainer's logprobs of the server's samples equal
    the server's policy logprobs (so the pushes landed), also under penalties the server applies per request (the
    trainer's IS quantity stays `log_softmax(logits / T)`, not the penalised distribution's)."""
    _, url = server
    trainer = make_trainer(kind, tokenizer, tmp_path, cb_server_urls=[url], cb_server_api_key=KEY, **settings)
    start = time.monotonic()
    trainer.train()
    print(f"\n2-step {kind} on the server: {time.monotonic() - start:.1f} s")
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and trainer.rollouts.generator is None, "no local engine on the server path"
    assert trainer.rollouts.remote.weight_version == 2, "one push per step"
    metrics = requests.get(url + "/metrics", headers=METRICS_JSON, timeout=5).json()
    assert metrics["weight_version"] == 2
    # The trainer's own logprobs of the server's samples: equal up to batching noise only if the weights synced.
    gaps = [entry["sampling/sampling_logp_difference/max"] for entry in logs]
    print(f"trainer vs server logprob max|d| per step: {gaps}")
    assert max(gaps) < FP32_LOGPROB_TOL
    sent = trainer.rollouts.remote.sampling()
    expected = (1.2, 0.05, 0.5) if settings else (1.0, 0.0, 0.0)  # what the server was asked to apply
    assert (sent["repetition_penalty"], sent["min_p"], sent["presence_penalty"]) == expected


def test_settings_the_api_does_not_carry_are_refused(server, tokenizer, tmp_path):
    _, url = server
    trainer = make_trainer("grpo", tokenizer, tmp_path, cb_server_urls=[url], generation_kwargs={"typical_p": 0.9})
    with pytest.raises(ValueError, match=r"cannot apply \[.typical_p.\]"):
        trainer.train()


def test_weight_update_with_unknown_names_is_refused(server, local_model):
    _, url = server
    sender = WeightSender(url, api_key=KEY, timeout=30)
    sender.init()
    body = {"token": sender._token, "version": 9, "params": [["no.such.weight", "torch.float32", [2]]]}
    response = requests.post(url + "/weights/update", json=body, headers=AUTH, timeout=5)
    assert response.status_code == 400 and "no.such.weight" in response.text
    sender.close()


def test_request_errors_are_not_resubmitted(server):
    _, url = server
    client = RolloutClient([url], api_key=KEY, timeout=10)
    with pytest.raises(ValueError, match="outside the model.s vocabulary"):
        client.generate([[5, 10**7]], 1, max_tokens=4)


def test_hung_replica_times_out(prompts):
    with socket.socket() as listener:  # accepts connections (backlog), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        client = RolloutClient([url], timeout=1.0)
        start = time.monotonic()
        with pytest.raises(RolloutServerError, match="Timeout"):
            client.generate(prompts[:1], 1, max_tokens=4)
        elapsed = time.monotonic() - start
    print(f"\nhung-replica-to-error: {elapsed:.2f} s")
    assert elapsed < 3


def test_dead_replica_is_skipped(server, prompts):
    _, url = server
    dead = f"http://127.0.0.1:{free_port()}"
    client = RolloutClient([dead, url], api_key=KEY, timeout=10)
    client.known_versions |= {1, 2}
    result = client.generate(prompts[:4], 2, max_tokens=8)
    assert len(result.completion_ids) == 8 and all(len(ids) for ids in result.completion_ids)


def test_ctrl_c_stops_the_server_within_2_s(checkpoint):
    with running_server(checkpoint) as (proc, url):
        assert requests.get(url + "/v1/models", timeout=5).status_code == 200  # no key set: open
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
        elapsed = time.monotonic() - start
    print(f"\nSIGINT-to-exit: {elapsed:.2f} s")
    assert elapsed < 2


def test_ctrl_c_on_a_paused_server_answers_its_queued_clients_503(checkpoint):
    """A paused server's queued request, at SIGINT, gets a retryable 503 (`Retry-After`), not uvicorn's 500 for a
    request it cancels. Gated on the server's state (the group queued), not on a sleep."""
    with running_server(checkpoint) as (proc, url):
        assert requests.post(url + "/pause", timeout=5).json() == {"paused": True}
        answers: list[requests.Response] = []
        body = {"prompt": [[5, 6, 7]], "max_tokens": 4}
        client = threading.Thread(target=lambda: answers.append(requests.post(url + "/v1/completions", json=body)))
        client.start()
        while (
            requests.get(url + "/metrics", headers={"Accept": "application/json"}, timeout=5).json()["queue_groups"]
            < 1
        ):
            assert client.is_alive(), answers
        proc.send_signal(signal.SIGINT)
        client.join(timeout=30)
        proc.wait(timeout=30)
    (answer,) = answers
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == "1" and "shutting down" in answer.json()["detail"]


def test_killed_server_raises_quickly(server, prompts):
    proc, url = server
    proc.kill()
    proc.wait(timeout=10)
    client = RolloutClient([url, f"http://127.0.0.1:{free_port()}"], api_key=KEY, timeout=5)
    start = time.monotonic()
    with pytest.raises(RolloutServerError) as info:
        client.generate(prompts[:2], 2, max_tokens=8)
    elapsed = time.monotonic() - start
    print(f"\nkill-to-error: {elapsed:.2f} s")
    assert url in str(info.value) and elapsed < 5
