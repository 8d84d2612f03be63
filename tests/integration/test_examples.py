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
def test_openai_client_bridge_trains_with_exact_is(tmp_path):
    """The bridge example offline: a local server, the `openai` client's multi-turn episodes fed to the trainer
    through `rollout_func`; the trainer's logprobs of the returned tokens equal the server's (the weights pushed each
    step; a stale or re-tokenized token would show here), every step."""
    import ast

    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "agent_openai_client.py"), "--output_dir", str(tmp_path),
         "--max_steps", "2", "--num_examples", "8"],
        capture_output=True, text=True, timeout=600, env={"HF_HUB_OFFLINE": "1", **_env()},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [ast.literal_eval(line) for line in proc.stdout.splitlines() if line.startswith("{'rewards")]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["sampling/sampling_logp_difference/max"] < 1e-4 for s in steps)


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)
