"""Engine forwards skip transformers' attention-mask construction (the placeholder of `engine/_upstream_patches.py`).

With the skip on, an engine round never runs the mask builders' packed-sequence scan (`find_packed_sequence_indices`,
called by `create_causal_mask` for every forward given no mask) and gives the same tokens and logprobs, bit for bit,
as without the placeholder (a seeded round of forked samples on a sliding-window model, so both mask builders
run); control: with the skip off the scan runs in every engine forward, so the spy would see a skip that stopped
working (transformers 5.23; 5.24 skips the builders for the engine's cache itself). A training forward (no engine)
still gets its mask.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, Qwen2Config, masking_utils

from tests.conftest import sampling_config
from trl_cb import ContinuousBatchingGenerator
from trl_cb.engine import _upstream_patches
from trl_cb.offline.tiny import tiny_model


def _skip_mask(monkeypatch, skip: bool) -> None:
    """Without `skip`, engines are built without the placeholder (upstream's mask construction: the reference)."""
    if not skip:
        monkeypatch.setattr(_upstream_patches, "_with_placeholder_mask", lambda compute, model, name: compute)


def _round(tokenizer, prompts, monkeypatch, skip: bool) -> tuple[list, list, int]:
    """Completions, logprobs and the number of packed-sequence scans of one seeded round."""
    _skip_mask(monkeypatch, skip)
    scans = []
    scan = masking_utils.find_packed_sequence_indices

    def counted(*args: object, **kwargs: object):
        scans.append(1)
        return scan(*args, **kwargs)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", counted)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=1,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=24)) as gen:
        torch.manual_seed(0)
        out = gen.generate([p[:20] for p in prompts[:3]], num_generations=3)
    return out.completion_ids, out.logprobs, len(scans)


#: Per tested release: whether an engine forward without the placeholder runs the mask builders' preprocessing (5.24
#: returns at once for a `PagedAttentionCache` itself, so there the skip changes nothing).
ENGINE_FORWARDS_BUILD_MASKS = {"5.23": True, "5.24": False}


def test_engine_forwards_skip_the_mask_and_sample_the_same(tokenizer, prompts, monkeypatch):
    ids, logprobs, scans = _round(tokenizer, prompts, monkeypatch, skip=True)
    built_ids, built_logprobs, built_scans = _round(tokenizer, prompts, monkeypatch, skip=False)
    release = ".".join(transformers.__version__.split(".")[:2])
    if ENGINE_FORWARDS_BUILD_MASKS[release]:
        assert built_scans > 10, "control: without the skip every engine forward scans position_ids"
    else:
        assert built_scans == 0, "this release builds masks in engine forwards again: update the table"
    assert scans == 0, f"{scans} engine forwards still built a mask"
    assert ids == built_ids and logprobs == built_logprobs


@pytest.mark.parametrize("skip", [True, False])
def test_a_training_forward_keeps_its_padding_mask(tokenizer, monkeypatch, skip):
    """Outside the engine nothing changes: a left-padded batch gives the unpadded row's logits."""
    _skip_mask(monkeypatch, skip)
    model = tiny_model(tokenizer)
    ids = torch.tensor([[5, 6, 7, 8], [0, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=2)) as gen:
        gen.generate([[5, 6, 7]], num_generations=1)
        with torch.no_grad():
            padded = model(input_ids=ids, attention_mask=mask).logits[1, -1]
            alone = model(input_ids=ids[1:, 1:]).logits[0, -1]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)
