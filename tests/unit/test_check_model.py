"""`python -m trl_cb.check_model`: PASS on a served checkpoint, FAIL with the reason on a refused one or a gap."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.model_zoo import REFUSED, SUPPORTED, WINDOW, tiny_arch_model, tiny_config
from trl_cb import check_model, compat


def _save(tmp_path: Path, tokenizer, model=None, config=None) -> str:
    """A checkpoint directory as a user has it: weights (or only a config) and the tokenizer."""
    path = tmp_path / "ckpt"
    if model is not None:
        model.save_pretrained(path)
    else:
        config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _special_ids(tokenizer) -> dict[str, int]:
    return dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)  # fmt: skip


def test_pass_on_a_served_checkpoint(tokenizer, tmp_path, capsys):
    """Tiny Mistral, weights std 0.2, prompts made longer than its 8-token window."""
    arch = next(a for a in SUPPORTED if a.model_type == "mistral")
    path = _save(tmp_path, tokenizer, model=tiny_arch_model(arch, len(tokenizer), _special_ids(tokenizer)))
    argv = [path, "--num-prompts", "2", "--max-new-tokens", "12", "--prompt-tokens", str(2 * WINDOW)]
    assert check_model.main(argv) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "FAIL" not in out
    assert "was not crossed" not in out, "the window must be exercised"


def test_fail_reports_the_gap_and_where_it_starts(tokenizer, tmp_path, capsys, monkeypatch):
    """Control: a model whose engine view drops the window (layer_types say full attention, the model attends
    through an 8-token window) — let past the up-front checks on purpose — fails with a gap that starts once a
    sequence is longer than the window."""
    arch = next(a for a in SUPPORTED if a.model_type == "mistral")
    model = tiny_arch_model(arch, len(tokenizer), _special_ids(tokenizer))
    path = _save(tmp_path, tokenizer, model=model)
    model.config.layer_types = ["full_attention"] * model.config.num_hidden_layers
    with pytest.raises(compat.UnsupportedModelError, match="sliding_window=8 but the engine would use None"):
        compat.check_model(model)  # what check-model would say without the bypass below
    monkeypatch.setattr(check_model, "_load", lambda args, device, dtype: (model, tokenizer))
    monkeypatch.setattr(compat, "probe_problems", lambda model: [])
    argv = [path, "--num-prompts", "2", "--max-new-tokens", "12", "--prompt-tokens", "6"]
    assert check_model.main(argv) == 1
    out = capsys.readouterr().out
    assert "FAIL: logprob gap" in out and "PASS" not in out
    position = int(out.split("sequence position ")[1].split(")")[0])
    assert position >= WINDOW, "the gap can only start once a sequence outgrows the window"


def test_refused_architecture_exits_nonzero_before_loading_weights(tokenizer, tmp_path):
    """Only config.json and the tokenizer exist: the refusal comes from the config, through the module entry point."""
    arch, reason = next((a, r) for a, r in REFUSED if a.model_type == "deepseek_v3")
    path = _save(tmp_path, tokenizer, config=tiny_config(arch, len(tokenizer)))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [sys.executable, "-m", "trl_cb.check_model", path, "--device", "cpu"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL: refused architecture" in proc.stdout
    assert reason in proc.stdout and "use_transformers_continuous_batching=False" in proc.stdout
