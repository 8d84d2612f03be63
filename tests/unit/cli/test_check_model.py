"""`python -m trl_cb.cli.check_model`: PASS on a served checkpoint, FAIL with the reason on a refused one or a gap."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import torch

from tests.model_zoo import REFUSED, SUPPORTED, WINDOW, tiny_arch_model, tiny_config
from trl_cb.cli import check_model


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
    """Control: an engine that computes a different model from sequence position ERROR_FROM on (a hook shifts the
    final hidden states there, only in the engine's thread) fails, and the report points at the first token the
    shifted states produced (position ERROR_FROM + 1)."""
    error_from = 10
    arch = next(a for a in SUPPORTED if a.model_type == "llama")
    model = tiny_arch_model(arch, len(tokenizer), _special_ids(tokenizer))
    path = _save(tmp_path, tokenizer, model=model)
    caller = threading.current_thread()
    positions: dict[str, torch.Tensor] = {}

    def remember_positions(module, args, kwargs):
        positions["ids"] = kwargs.get("position_ids")

    def shift_late_positions(module, args, output):
        ids = positions.get("ids")
        if threading.current_thread() is caller or ids is None:
            return output
        late = (ids >= error_from)[..., None].to(output.dtype)  # (1, N, 1)
        return output + late  # (1, N, H)

    model.register_forward_pre_hook(remember_positions, with_kwargs=True)
    model.model.norm.register_forward_hook(shift_late_positions)
    monkeypatch.setattr(check_model, "_load", lambda args, device, dtype: (model, tokenizer))
    argv = [path, "--num-prompts", "2", "--max-new-tokens", "12", "--prompt-tokens", "6"]
    assert check_model.main(argv) == 1
    out = capsys.readouterr().out
    assert "FAIL: logprob gap" in out and "PASS" not in out
    assert f"(sequence position {error_from + 1})" in out, out


def test_refused_architecture_exits_nonzero_before_loading_weights(tokenizer, tmp_path):
    """Only config.json and the tokenizer exist: the refusal comes from the config, through the module entry point."""
    arch, reason = next((a, r) for a, r in REFUSED if a.model_type == "deepseek_v3")
    path = _save(tmp_path, tokenizer, config=tiny_config(arch, len(tokenizer)))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    proc = subprocess.run(
        [sys.executable, "-m", "trl_cb.cli.check_model", path, "--device", "cpu"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL: refused architecture" in proc.stdout
    assert reason in proc.stdout and "use_transformers_continuous_batching=False" in proc.stdout
