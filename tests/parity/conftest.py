"""Fixtures for the parity suite: a saved tiny checkpoint (TRL builds reference models from a path), its tokenizer
(plain, and with a chat template for conversational prompts), and rewards that vary across samples."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from trl_cb.offline.tiny import tiny_checkpoint

CHAT_TEMPLATE = (
    "{%- for m in messages -%}{{ m.role }}: {{ m.content }}\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}assistant:{%- endif -%}"
)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen2 whose completions end at varied lengths (advantages and truncation both vary)."""
    return tiny_checkpoint(tmp_path_factory.mktemp("parity_ckpt"), eos_logit_bias=8.0)


@pytest.fixture(scope="session")
def tokenizer(checkpoint: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(checkpoint)


@pytest.fixture(scope="session")
def chat_tokenizer(checkpoint: str) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast.from_pretrained(checkpoint)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def length_reward(completions: list, **kwargs: object) -> list[float]:
    return [len(str(c)) / 40.0 for c in completions]


def digit_reward(completions: list, **kwargs: object) -> list[float]:
    return [float(sum(ch.isdigit() for ch in str(c))) for c in completions]
