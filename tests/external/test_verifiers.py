"""An RL environment library's own clients, unmodified, against `trl-cb serve`: `verifiers` 0.4's training client
(token in, vLLM's `/inference/v1/generate`) and evaluation client (chat, with a tool and its result).

Opt-in: `verifiers` pins an `openai` below the one trl_cb's tests use, so it lives in its own environment, named by
`TRL_CB_VERIFIERS_PYTHON` (`python -m venv VF && VF/bin/pip install verifiers==0.4.0`, docs/server.md);
skipped without it. The server runs from this checkout; the driver (`verifiers_driver.py`) in that environment.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.unit.rollouts.test_generator import teacher_forced_logprobs
from tests.unit.serving.conftest import KEY, running_server, save_sharp_checkpoint

VERIFIERS_PYTHON = os.environ.get("TRL_CB_VERIFIERS_PYTHON")
TOLERANCE = 1e-5  # fp32 server against this process's teacher-forced forward
EOS_LOGIT_BIAS = 2.0  # some completions end before max_tokens

pytestmark = pytest.mark.skipif(
    not VERIFIERS_PYTHON, reason="set TRL_CB_VERIFIERS_PYTHON to a Python with verifiers 0.4 installed"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer) -> str:
    return save_sharp_checkpoint(tmp_path_factory, tokenizer, "ckpt-verifiers", eos_logit_bias=EOS_LOGIT_BIAS)


@pytest.fixture(scope="module")
def local_model(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def answers(checkpoint) -> dict:
    driver = Path(__file__).with_name("verifiers_driver.py")
    with running_server(checkpoint, "--api-key", KEY) as (_, url):
        done = subprocess.run([VERIFIERS_PYTHON, str(driver), url + "/v1", checkpoint, KEY],
                              capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_training_client_turns_are_exact(answers, local_model):
    """Every token-in turn completes; its prompt and completion ids and logprobs are the engine's, equal to teacher
    forcing; control: the same completions after another turn's prompt are far off."""
    turns = answers["train"]
    assert len(turns) == 3 and all(t["finish_reason"] in ("stop", "length") for t in turns)
    for i, turn in enumerate(turns):
        assert turn["prompt_ids"] and len(turn["completion_ids"]) == len(turn["completion_logprobs"]) > 0
        recorded = torch.tensor(turn["completion_logprobs"])
        ref = teacher_forced_logprobs(local_model, turn["prompt_ids"], turn["completion_ids"], 1.0, 0, 1.0)
        assert (ref - recorded).abs().max().item() <= TOLERANCE
        other = turns[(i + 1) % len(turns)]["prompt_ids"]
        wrong = teacher_forced_logprobs(local_model, other, turn["completion_ids"], 1.0, 0, 1.0)
        assert (wrong - recorded).abs().max().item() >= 0.1


def test_evaluation_client_offers_a_tool_and_takes_its_result(answers):
    chats = answers["eval"]
    assert len(chats) == 2 and all(c["finish_reason"] in ("stop", "length", "tool_calls") for c in chats)
