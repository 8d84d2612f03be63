"""The server's persistent engine: weight updates between engine steps mid-request (exact per-token versions),
streaming, pause/resume, cancellation of a gone client, and async GRPO training on a server.

One server (tiny std-0.2 model without an EOS bias, so completions run to `max_tokens`; fp32, one thread) serves
the module; every process started here is stopped in the fixtures' `finally`.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import requests
import torch
from transformers import DynamicCache

from tests.unit.serving.conftest import (
    AUTH,
    FP32_LOGPROB_TOL,
    KEY,
    metrics,
    running_server,
)
from tests.unit.serving.test_server import perturbed
from tests.unit.trainers.test_trainers import make_trainer
from trl_cb.serving.client import RolloutClient
from trl_cb.serving.weight_sync import WeightSender


def post(url: str, path: str) -> None:
    assert requests.post(url + path, headers=AUTH, timeout=30).status_code == 200


@torch.no_grad()
def straddling_reference(old, new, prompt: list[int], tokens: list[int], switch: int) -> torch.Tensor:
    """Logprobs of `tokens` when tokens `< switch` were sampled by `old` and the rest by `new` over the KV prefix
    `old` wrote: the step sampling token `switch` runs `new` on input token `switch - 1` and attends to old keys."""
    if switch in (0, len(tokens)):  # one set of weights sampled every token
        sequence = torch.tensor([prompt + tokens])
        logits = (new if switch == 0 else old)(sequence).logits[0, len(prompt) - 1 : -1]
        return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    return split_reference(old, new, prompt, tokens, len(prompt) + switch - 1)


def split_reference(old, new, prompt: list[int], tokens: list[int], split: int) -> torch.Tensor:
    """Logprobs of `tokens` when the first `split` inputs (prompt, then tokens) were processed by `old` and the rest
    by `new` over the cache `old` wrote."""
    sequence = torch.tensor([prompt + tokens])
    cache = DynamicCache(config=old.config)
    before = old(sequence[:, :split], past_key_values=cache, use_cache=True).logits[0]
    after = new(sequence[:, split:-1], past_key_values=cache, use_cache=True).logits[0]
    logits = torch.cat([before[len(prompt) - 1 :], after])
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def switch_gap(old, new, prompt: list[int], tokens: list[int], got: torch.Tensor, switch: int) -> float:
    """Max |reference - served| of a completion whose tokens switch from `old` to `new` weights at `switch`.

    A completion the new weights sampled from its first token (switch 0) had its prompt processed by the new weights
    (prefilled after the update), or by the old ones but for its last token: a prompt with forked samples is prefilled
    up to its last token and forked, and the next step processes that token and samples the first one (transformers'
    scheduler), so an update landing between those two steps leaves exactly that split. Both are what the engine did
    (the per-token versions name the weights that sampled each token either way); the closer one is compared."""
    gap = (straddling_reference(old, new, prompt, tokens, switch) - got).abs().max().item()
    if switch == 0 and len(prompt) > 1:
        forked = split_reference(old, new, prompt, tokens, len(prompt) - 1)
        gap = min(gap, (forked - got).abs().max().item())
    return gap


def pause_push_resume(
    url: str,
    client: RolloutClient,
    sender: WeightSender,
    batch,
    new_model,
    version: int,
    max_tokens: int,
    decoding_s: float,
) -> tuple[object, dict]:
    """Generate `batch` (2 samples each); once the server runs it and `decoding_s` later, pause, push `new_model`
    as `version`, resume. Returns the result and the metrics seen while paused."""
    outcome: dict = {}
    worker = threading.Thread(
        target=lambda: outcome.update(result=client.generate(batch, 2, max_tokens=max_tokens).as_lists())
    )
    worker.start()
    deadline = time.monotonic() + 30
    while metrics(url)["running_groups"] == 0:  # submitted
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(decoding_s)
    post(url, "/pause")
    client.known_versions.add(version)
    sender.push(new_model, version)  # applied while the engine holds its requests
    state = metrics(url)
    post(url, "/resume")
    worker.join(timeout=300)
    return outcome["result"], state


def update_inside_a_request(
    url: str, client: RolloutClient, sender: WeightSender, batch: list, model: torch.nn.Module, max_tokens: int
) -> tuple[Any, dict, torch.nn.Module, torch.nn.Module, int]:
    """Push perturbed weights while `batch` generates, retried until the update lands inside a request.

    "Mid-generation" is proven from the per-token versions, not assumed from a sleep: if every completion ended before
    the pause (a fast machine) the next try generates 4x longer; if none had started decoding (a slow one), the next
    try waits 4x longer before pausing. Returns the result, the server's state while paused, the weights before and
    after the update that landed, and its version."""
    old, decoding_s = model, 0.08
    for version in range(1, 6):
        new_model = perturbed(old)
        result, state = pause_push_resume(url, client, sender, batch, new_model, version, max_tokens, decoding_s)
        assert state["paused"] and state["weight_version"] == version
        switches = [v.index(version) if version in v else len(v) for v in result.token_weight_versions]
        if any(0 < s < len(t) for s, t in zip(switches, result.completion_ids)):
            break
        if all(s == len(t) for s, t in zip(switches, result.completion_ids)):
            max_tokens *= 4  # every completion ended before the pause
        else:
            decoding_s *= 4  # the pause came before decoding
        old = new_model
    return result, state, old, new_model, version


def test_update_mid_request_switches_versions_per_token_exactly(server, local_model, prompts):
    """Pause while requests are mid-generation, push new weights, resume: each token reports the weights that
    sampled it, and its logprob is exactly that of old weights before the switch and new weights (over the old KV
    prefix) after it. Controls: the old weights alone, and the new weights recomputing the prefix, both miss.
    "Mid-generation" is proven, not assumed (`update_inside_a_request`)."""
    _, url = server
    client = RolloutClient([url], api_key=KEY, timeout=300)
    sender = WeightSender(url, api_key=KEY, timeout=60)
    batch = [p for p in prompts for _ in range(2)][:12]
    # completions without an EOS bias run to max_tokens
    result, state, old, new_model, version = update_inside_a_request(url, client, sender, batch, local_model, 64)
    assert state["weight_updates_in_flight"] >= 1

    gaps, old_only, new_prefix, straddling = [], [], [], 0
    for i, (tokens, logprobs, versions) in enumerate(
        zip(result.completion_ids, result.policy_logprobs, result.token_weight_versions)
    ):
        assert len(tokens) == len(versions) and versions == sorted(versions)
        assert set(versions) <= {version - 1, version}
        switch = versions.index(version) if version in versions else len(versions)
        straddling += 0 < switch < len(tokens)
        prompt, got = batch[i // 2], torch.tensor(logprobs)
        gaps.append(switch_gap(old, new_model, prompt, tokens, got, switch))
        if 0 < switch < len(tokens):
            old_only.append((straddling_reference(old, old, prompt, tokens, 0) - got).abs().max())
            new_prefix.append((straddling_reference(new_model, new_model, prompt, tokens, 0) - got).abs().max())
    print(
        f"\n{straddling}/{len(gaps)} completions straddle update {version} "
        f"({max(len(t) for t in result.completion_ids)} tokens); "
        f"max|d|={max(gaps):.2e}; controls: old weights "
        f"{min(old_only):.3f}, new weights over a recomputed prefix {min(new_prefix):.3f}"
    )
    assert straddling >= 1, "the update landed between requests, not inside one"
    assert max(gaps) <= FP32_LOGPROB_TOL and min(old_only) > 0.05 and min(new_prefix) > 1e-3
    sender.close()


def test_stream_returns_each_group_as_one_line(server, prompts):
    _, url = server
    body = {"prompt": prompts[:3], "n": 2, "max_tokens": 4}
    with requests.post(url + "/v1/completions/stream", json=body, headers=AUTH, stream=True, timeout=60) as response:
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert sorted(line["prompt_index"] for line in lines) == [0, 1, 2]
    for line in lines:
        assert [c["index"] for c in line["choices"]] == [line["prompt_index"] * 2, line["prompt_index"] * 2 + 1]
        # At most 4 tokens: this checkpoint has no EOS bias, but EOS can still be sampled (by chance, not speed).
        assert all(1 <= len(c["token_ids"]) == len(c["token_weight_versions"]) <= 4 for c in line["choices"])


def test_pause_holds_requests_and_a_gone_client_cancels_them(server, prompts):
    _, url = server
    post(url, "/pause")
    try:
        before = metrics(url)["groups_cancelled"]
        with pytest.raises(requests.Timeout):  # nothing runs while paused; the client gives up
            requests.post(
                url + "/v1/completions", json={"prompt": prompts[:2], "max_tokens": 4}, headers=AUTH, timeout=0.5
            )
        deadline = time.monotonic() + 5
        while metrics(url)["groups_cancelled"] < before + 2:
            assert time.monotonic() < deadline, "the gone client's groups were not cancelled"
            time.sleep(0.05)
        assert metrics(url)["queue_groups"] == 0
    finally:
        post(url, "/resume")
    body = {"prompt": prompts[:2], "max_tokens": 4}
    assert requests.post(url + "/v1/completions", json=body, headers=AUTH, timeout=30).status_code == 200


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_async_training_overlaps_with_the_server(server, tokenizer, tmp_path, kind):
    """cb_async_generation on a server: the trainer pushes weights after every optimizer step while groups stay
    requested ahead; every token's version is one the trainer pushed and within the staleness bound."""
    _, url = server
    trainer = make_trainer(
        kind,
        tokenizer,
        tmp_path,
        max_steps=3,
        cb_server_urls=[url],
        cb_server_api_key=KEY,
        cb_async_generation=True,
    )
    start = time.monotonic()
    trainer.train()
    print(f"\n3-step async {kind} on the server: {time.monotonic() - start:.1f} s")
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3 and trainer.rollouts.generator is None
    assert trainer.rollouts.remote.weight_version == 4, "one push at start, one per optimizer step"
    assert metrics(url)["weight_version"] == 4
    assert [entry["async/policy_version"] for entry in logs] == [1.0, 2.0, 3.0]
    assert all(entry["async/staleness_max"] <= 2 for entry in logs)
    assert max(entry["sampling/sampling_logp_difference/max"] for entry in logs[:1]) < FP32_LOGPROB_TOL  # fresh: exact


def test_async_training_survives_a_killed_replica(server, checkpoint, tokenizer, tmp_path):
    """Two replicas share the groups; one is killed after the first step: its groups in flight are resubmitted to
    the other, the next push drops it (it would serve old weights), and training finishes on the survivor."""
    from transformers import TrainerCallback

    _, url = server
    with running_server(checkpoint, "--api-key", KEY) as (victim, second):
        seen: dict = {}

        class KillAfterFirstStep(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 1:
                    seen["before"] = metrics(second)["groups_finished"]
                    victim.kill()
                    victim.wait(timeout=10)
                if state.global_step == 2:  # the push after step 2 found it dead
                    seen["replicas"] = list(trainer.rollouts.remote.client.urls)

        trainer = make_trainer(
            "grpo", tokenizer, tmp_path, max_steps=3, cb_server_urls=[url, second], cb_server_api_key=KEY,
            cb_async_generation=True, cb_async_prefetch_depth=0,
        )  # fmt: skip
        trainer.add_callback(KillAfterFirstStep())
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    print(f"\ngroups served by the killed replica before the kill: {seen['before']}")
    assert len(logs) == 3 and seen["before"] > 0, "both replicas served"
    assert seen["replicas"] == [url], "the replica that missed a push is no longer sampled"
    assert trainer.rollouts.remote.weight_version == 4 and metrics(url)["weight_version"] == 4
