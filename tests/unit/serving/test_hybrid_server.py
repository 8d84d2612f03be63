"""A rollout server (`trl-cb serve`) on a hybrid checkpoint (Qwen3.5 layout: Gated DeltaNet + attention): weights
pushed while requests are mid-generation switch versions per token, and each token's logprob is the old weights'
before the switch and the new weights' after it, over the recurrent state (and KV) the old weights wrote.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.rollouts.test_hybrid_rollouts import FP32_HYBRID_TOL
from tests.unit.serving.conftest import KEY
from tests.unit.serving.test_inflight import straddling_reference, switch_gap, update_inside_a_request
from trl_cb.offline.tiny import tiny_model
from trl_cb.serving.client import RolloutClient
from trl_cb.serving.weight_sync import WeightSender


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer) -> str:
    """Qwen3.5's layout, std 0.2, no EOS bias (completions run to max_tokens)."""
    directory = tmp_path_factory.mktemp("ckpt-hybrid")
    tiny_model(tokenizer, architecture="qwen3_5", init_std=0.2).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def test_update_mid_request_on_a_hybrid_server(server, local_model, prompts):
    _, url = server
    client = RolloutClient([url], api_key=KEY, timeout=300)
    sender = WeightSender(url, api_key=KEY, timeout=60)
    batch = [p for p in prompts for _ in range(2)][:8]
    result, _, old, new_model, version = update_inside_a_request(url, client, sender, batch, local_model, 48)
    sender.close()
    gaps, new_prefix = [], []
    for i, (tokens, logprobs, versions) in enumerate(
        zip(result.completion_ids, result.policy_logprobs, result.token_weight_versions)
    ):
        switch = versions.index(version) if version in versions else len(versions)
        prompt, got = batch[i // 2], torch.tensor(logprobs)
        gaps.append(switch_gap(old, new_model, prompt, tokens, got, switch))
        if 0 < switch < len(tokens):
            recomputed = straddling_reference(new_model, new_model, prompt, tokens, 0)
            new_prefix.append((recomputed[switch:] - got[switch:]).abs().max().item())
    print(f"\n[hybrid] server update mid-request: {len(new_prefix)} straddling, max {max(gaps):.1e}, new weights "
          f"over a recomputed prefix {min(new_prefix):.1e}")  # fmt: skip
    assert new_prefix, "the update landed between requests, not inside one"
    assert max(gaps) <= FP32_HYBRID_TOL and min(new_prefix) > 10 * FP32_HYBRID_TOL
