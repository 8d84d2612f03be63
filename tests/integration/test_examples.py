"""The example scripts run offline at the smallest size (so they never rot)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo_gsm8k.py", "rloo_gsm8k.py", "agent_gsm8k.py"])
def test_example_runs_offline(script, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--output_dir", str(tmp_path), "--max_steps", "1",
         "--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "8",
         "--num_examples", "8"],
        capture_output=True, text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", **_env()},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'step': 1" in proc.stdout


@pytest.mark.parametrize("script", ["grpo_gsm8k.py", "rloo_gsm8k.py", "agent_gsm8k.py", "agent_openai_client.py"])
def test_example_help(script):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "--use_transformers_continuous_batching" in proc.stdout
    assert "--model_name_or_path" in proc.stdout and "--data_file" in proc.stdout


@pytest.mark.slow
def test_agent_example_learns_by_default(tmp_path):
    """`examples/agent_gsm8k.py`'s default offline run (the command in its docstring, ~20 s) shows learning through
    the async tool loop: the reward at the last step is above the first (the policy learns to answer after one
    calculator call: from about 0.3 to 1.0), not the flat 0 a new user would read as broken."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "agent_gsm8k.py"), "--output_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={"HF_HUB_OFFLINE": "1", **_env()},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = _printed_steps(proc.stdout)
    assert [s["step"] for s in steps] == list(range(1, 9))
    assert all(s["tools/call_frequency"] >= 1 for s in steps)  # every rollout went through the tool
    assert steps[-1]["reward"] > steps[0]["reward"], [s["reward"] for s in steps]


@pytest.mark.slow
def test_openai_client_bridge_trains_with_exact_is(tmp_path):
    """The bridge example's default offline run (~50 s): a local server, the `openai` client's multi-turn episodes fed
    to the trainer through `rollout_func`; the trainer's logprobs of the returned tokens equal the server's (the
    weights pushed each step; a stale or re-tokenized token would show here), every step, and the reward rises (the
    episodes reach their second turn, and the policy learns to answer after one call)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "agent_openai_client.py"), "--output_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={"HF_HUB_OFFLINE": "1", **_env()},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = _printed_steps(proc.stdout)
    assert [s["step"] for s in steps] == list(range(1, 11))
    assert all(s["sampling/sampling_logp_difference/max"] < 1e-4 for s in steps)
    assert steps[-1]["reward"] > steps[0]["reward"], [s["reward"] for s in steps]


def _printed_steps(stdout: str) -> list[dict]:
    """The per-step dicts the agent examples print after training (one line each, with a `step` key)."""
    import ast

    return [ast.literal_eval(line) for line in stdout.splitlines() if line.startswith("{") and "'step':" in line]


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)
