"""Shared fixtures: a tiny random Qwen2 and a locally trained tokenizer (no hub, no network)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

if not torch.cuda.is_available():
    # trl_cb's Triton kernel (`engine/triton_decode.py`) runs in Triton's CPU interpreter where there is no GPU. Triton
    # reads the flag when it is first imported (its own library functions are jitted then): set it before any test can.
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast

from trl_cb.offline.data import synthetic_gsm8k
from trl_cb.offline.tiny import tiny_model, tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return tiny_tokenizer()


@pytest.fixture
def model(tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """Fresh fp32 tiny model whose completions end at varied lengths."""
    return tiny_model(tokenizer, eos_logit_bias=4.0)


@pytest.fixture
def sharp_model(tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """Fresh fp32 tiny model with weights of std 0.2: next-token distributions far from uniform, so that a logprob
    comparison can fail (at the default 0.02 they are nearly uniform and almost any error passes 1e-4)."""
    return tiny_model(tokenizer, eos_logit_bias=4.0, init_std=0.2)


@pytest.fixture(scope="session")
def prompts(tokenizer: PreTrainedTokenizerFast) -> list[list[int]]:
    return [tokenizer(r["prompt"])["input_ids"] for r in synthetic_gsm8k(6, seed=3)]


def sampling_config(tokenizer: PreTrainedTokenizerFast, **overrides: object) -> GenerationConfig:
    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=24,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    kwargs.update(overrides)
    return GenerationConfig(**kwargs)


@pytest.fixture(autouse=True)
def _no_leaked_threads():
    """Every test must leave no CB engine thread behind."""
    before = set(threading.enumerate())
    yield
    leaked = [
        t for t in threading.enumerate() if t not in before and t.is_alive() and "_run_generation_loop" in repr(t)
    ]
    for t in leaked:
        t.join(timeout=5)
    assert not [t for t in leaked if t.is_alive()], f"engine threads leaked: {leaked}"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
