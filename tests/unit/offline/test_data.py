"""The vendored GSM8K test split: shipped, complete, parsed, chat-formatted, and tokenized as TRL tokenizes it."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from trl_cb.offline.data import GSM8K_TEST_SIZE, gsm8k_reward, gsm8k_test, tokenize_prompt


def test_vendored_split_is_package_data_with_its_licence():
    folder = resources.files("trl_cb.offline") / "resources" / "gsm8k"
    assert "MIT License" in (folder / "LICENSE").read_text() and "OpenAI" in (folder / "LICENSE").read_text()
    lines = [json.loads(line) for line in (folder / "test.jsonl").read_text().splitlines() if line.strip()]
    assert len(lines) == GSM8K_TEST_SIZE == 1319
    assert lines[0]["question"].startswith("Janet")  # the unmodified upstream file, in its order


def test_records_parse_final_answer_and_are_chat_formatted():
    records = gsm8k_test()
    assert len(records) == GSM8K_TEST_SIZE
    assert records[0]["answer"] == "18" and records[0]["prompt"][0]["role"] == "user"
    assert all(r["answer"].lstrip("-").replace(".", "", 1).isdigit() for r in records)  # "1,000" -> "1000"
    assert all(len(r["prompt"]) == 1 and "####" in r["prompt"][0]["content"] for r in records)
    plain = gsm8k_test(3, conversational=False)
    assert [p["prompt"] for p in plain] == [r["prompt"][0]["content"] for r in records[:3]]


def test_seeded_subset_is_deterministic_and_differs_by_seed():
    a, b, c = gsm8k_test(20, seed=1), gsm8k_test(20, seed=1), gsm8k_test(20, seed=2)
    assert a == b and a != c and a != gsm8k_test(20)
    with pytest.raises(ValueError, match="num_examples"):
        gsm8k_test(GSM8K_TEST_SIZE + 1)


def test_reward_scores_chat_completions():
    rec = gsm8k_test(1)[0]
    right = [{"role": "assistant", "content": "so #### 18"}]
    wrong = [{"role": "assistant", "content": "#### 17"}]
    assert gsm8k_reward([right, wrong, "#### 18"], answer=[rec["answer"]] * 3) == [1.0, 0.0, 1.0]


def test_tokenize_prompt_matches_trl_chat_rendering(tokenizer):
    rec = gsm8k_test(1)[0]
    ids = tokenize_prompt(tokenizer, rec["prompt"])
    text = tokenizer.decode(ids)
    assert text.startswith("user: Janet") and text.endswith("\nassistant:")
    assert ids == tokenizer.apply_chat_template(rec["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"]
    assert tokenize_prompt(tokenizer, "plain text") == tokenizer("plain text")["input_ids"]
