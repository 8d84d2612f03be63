"""`trl-cb` as a user runs it: a subprocess, the shipped recipes, through `accelerate launch`, offline."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.test_distributed import distinct_port

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "examples" / "recipes"
IS_METRIC = "'sampling/importance_sampling_ratio/mean'"  # logged by trl_cb's trainers on the CB path only


def trl_cb(*args: str, tmp_path: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m trl_cb.cli ARGS` (what the `trl-cb` console script runs), hermetic: no user accelerate config
    (HF_HOME), a fresh tiny checkpoint (TMPDIR), no hub."""
    env = dict(
        os.environ,
        HF_HOME=str(tmp_path / "hf"),
        TMPDIR=str(tmp_path),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    for key in ("TRL_CB_LAUNCHED", "ACCELERATE_MIXED_PRECISION", "LOCAL_RANK"):  # start outside any launcher
        env.pop(key, None)
    cmd = [sys.executable, "-m", "trl_cb.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)


def test_help(tmp_path):
    proc = trl_cb("grpo", "--help", tmp_path=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in ("--use_transformers_continuous_batching", "--reward_funcs", "--model_name_or_path", "--datasets"):
        assert flag in proc.stdout, flag
    assert "accelerate launch" in proc.stdout and "trl-cb/tiny" in proc.stdout


def test_bad_flag_fails_clearly(tmp_path):
    proc = trl_cb("rloo", "--config", str(RECIPES / "rloo_tiny.yaml"), "--no_such_flag", "4", tmp_path=tmp_path)
    assert proc.returncode == 2
    assert "trl-cb rloo: error: unrecognized arguments: --no_such_flag 4" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()


def logged(stdout: str) -> list[dict[str, str]]:
    """The per-step log dicts the trainer printed (one line each, `{'loss': ...}`)."""
    return [ast.literal_eval(line) for line in stdout.splitlines() if line.startswith("{'loss'")]


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "rloo"])
def test_recipe_learns(algo, tmp_path):
    """The shipped recipe, re-run under `accelerate launch` (one process), trains with trl_cb's trainer, saves, and
    its logged reward rises (the first half of its steps; the whole recipe goes from about 0.05 to 0.65)."""
    out = tmp_path / "out"
    proc = trl_cb(
        algo, "--config", str(RECIPES / f"{algo}_tiny.yaml"), "--max_steps", "20", "--output_dir", str(out),
        tmp_path=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"trl-cb {algo}: process 0 of 1" in proc.stderr  # the re-run under `accelerate launch` trained
    logs = logged(proc.stdout)
    assert len(logs) == 4 and all(IS_METRIC.strip("'") in e for e in logs), proc.stdout[-3000:]  # CB path, every 5
    rewards = [float(e["reward"]) for e in logs]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.03, rewards
    assert float(logs[-1]["grad_norm"]) > 0
    assert (
        "FutureWarning" not in proc.stderr
    )  # no deprecation noise from TRL's calls (trl_cb/trainers/trl_internals.py)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_with_the_shipped_ddp_config(tmp_path):
    """`--accelerate_config examples/accelerate_configs/ddp.yaml --num_processes 2` (accelerate options, taken as
    `trl rloo` takes them) and `--use_cpu true` (gloo): two ranks, one run, both building the tiny checkpoint."""
    out = tmp_path / "out"
    proc = trl_cb(
        "rloo", "--config", str(RECIPES / "rloo_tiny.yaml"), "--max_steps", "2", "--logging_steps", "1",
        "--output_dir", str(out), "--accelerate_config", str(ROOT / "examples" / "accelerate_configs" / "ddp.yaml"),
        "--num_processes", "2", *distinct_port("--main_process_port"), "--use_cpu", "true", tmp_path=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"trl-cb rloo: process {rank} of 2 (DistributedType.MULTI_CPU)" in proc.stderr
    assert proc.stdout.count(IS_METRIC) == 2, proc.stdout[-3000:]  # logged once per step, by rank 0
    assert (out / "model.safetensors").is_file()
