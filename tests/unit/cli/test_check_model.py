"""`python -m trl_cb.cli.check_model`: PASS on a served checkpoint, FAIL with the reason on a refused one or a gap."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.model_zoo import REFUSED, SUPPORTED, WINDOW, tiny_arch_model, tiny_config
from trl_cb.cli import check_model
from trl_cb.offline.tiny import tiny_model, tiny_tokenizer


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


@pytest.mark.parametrize("model_type", ["gemma4_text", "deepseek_v3"])
def test_pass_on_per_group_cache_geometry(model_type, tokenizer, tmp_path, capsys):
    """Gemma 4 (per-layer head sizes, windows) and DeepSeek-V3 (the cached latent), saved and reloaded: each layer
    group's pages in its own shape (engine/_upstream_geometry.py)."""
    arch = next(a for a in SUPPORTED if a.model_type == model_type)
    path = _save(tmp_path, tokenizer, model=tiny_arch_model(arch, len(tokenizer), _special_ids(tokenizer)))
    argv = [path, "--num-prompts", "2", "--max-new-tokens", "12", "--prompt-tokens", str(2 * WINDOW)]
    assert check_model.main(argv) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "FAIL" not in out


def test_pass_on_a_hybrid_checkpoint(tokenizer, tmp_path, capsys):
    """Qwen3.5's layout (3 Gated DeltaNet layers + 1 full attention), weights std 0.2, 200-token prompts: served
    with per-sequence recurrent state (engine/recurrent_state.py). Its fp32 gap to teacher forcing is the model's
    own kernel noise (docs/models.md, "Hybrid models"), within the plain check's tolerance here (2.4e-5)."""
    model = tiny_model(tokenizer, architecture="qwen3_5", init_std=0.2)
    path = _save(tmp_path, tokenizer, model=model)
    argv = [path, "--num-prompts", "2", "--max-new-tokens", "12", "--prompt-tokens", "200"]
    assert check_model.main(argv) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "FAIL" not in out


def test_offline_model_name_is_resolved(capsys):
    """`trl-cb check-model trl-cb/tiny` (what CI runs on the installed wheel): the offline name is the local tiny
    checkpoint, as for `trl-cb grpo`, not a hub id looked up online."""
    assert check_model.main(["trl-cb/tiny", "--num-prompts", "1", "--max-new-tokens", "4"]) == 0
    assert "PASS" in capsys.readouterr().out


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
    arch, reason = next((a, r) for a, r in REFUSED if a.model_type == "minicpm3")
    path = _save(tmp_path, tokenizer, config=tiny_config(arch, len(tokenizer)))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    proc = subprocess.run(
        [sys.executable, "-m", "trl_cb.cli.check_model", path, "--device", "cpu"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL: refused architecture" in proc.stdout
    assert reason in proc.stdout and "use_transformers_continuous_batching=False" in proc.stdout


# ----------------------------------------------------------------------------------------------- --noise-floor


@pytest.fixture(scope="module")
def sharp_checkpoint(tmp_path_factory) -> str:
    """Weights of std 0.4 (hidden 256, 4 layers, 4,096-token vocabulary): with 128-token prompts the float32 forward's
    own kernel noise (~3e-4 on CPU) exceeds the plain check's 1e-4, as the H100 checkpoint's did."""
    tokenizer = tiny_tokenizer(4096)
    model = tiny_model(tokenizer, hidden_size=256, num_layers=4, num_attention_heads=4, init_std=0.4, seed=1)
    path = tmp_path_factory.mktemp("sharp") / "ckpt"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


_SHARP_ARGV = ["--num-prompts", "2", "--max-new-tokens", "24", "--prompt-tokens", "128", "--device", "cpu"]


@pytest.mark.slow
def test_noise_floor_passes_an_exact_engine_the_plain_check_fails(sharp_checkpoint, capsys):
    """The false FAIL the flag exists for: the plain check fails (and suggests the flag), `--noise-floor` passes with
    all three numbers printed and the control far above the bound."""
    assert check_model.main([sharp_checkpoint, *_SHARP_ARGV]) == 1
    plain = capsys.readouterr().out
    assert "FAIL: logprob gap" in plain and "rerun with --noise-floor" in plain, plain

    assert check_model.main([sharp_checkpoint, *_SHARP_ARGV, "--noise-floor"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "FAIL" not in out, out
    floor = {line.split(" vs float64:")[0].strip(): float(line.split("max ")[1].split()[0])
             for line in out.splitlines() if " vs float64:" in line}  # fmt: skip
    bound = float(out.split("bound = ")[1].split(" = ")[1].split()[0])
    assert set(floor) == {"CB", "forward (float32)", "control (prefix dropped)"}, out
    assert floor["forward (float32)"] > 1e-4, "the checkpoint no longer has noise above the plain tolerance"
    assert floor["CB"] <= bound < floor["control (prefix dropped)"], out


_BROKEN_ENGINES = {
    "off_by_0.05": lambda row: [lp + 0.05 for lp in row],  # far below the plain bf16 tolerance
    "shifted_by_one_token": lambda row: row[1:] + row[-1:],  # each token reports its successor's logprob
}


@pytest.mark.slow
@pytest.mark.parametrize("breakage", sorted(_BROKEN_ENGINES))
def test_noise_floor_fails_a_broken_engine(sharp_checkpoint, capsys, monkeypatch, breakage):
    """Control: an engine whose sampled logprobs are wrong fails with the flag, and the reason names the CB number."""
    sample, corrupt = check_model._sample, _BROKEN_ENGINES[breakage]

    def broken(*args, **kwargs):
        completions, logprobs, seconds = sample(*args, **kwargs)
        return completions, [corrupt(list(row)) for row in logprobs], seconds

    monkeypatch.setattr(check_model, "_sample", broken)
    argv = [sharp_checkpoint, "--num-prompts", "1", "--max-new-tokens", "8", "--prompt-tokens", "128", "--noise-floor"]
    assert check_model.main(argv) == 1
    out = capsys.readouterr().out
    assert "FAIL: CB vs float64 max" in out and "PASS" not in out, out
    if breakage == "off_by_0.05":
        assert "FAIL: CB vs float64 max 5.0" in out, out


def test_floor_verdict_rule():
    """The rule on numbers: the H100 measurements (docs/benchmarks.md, "Current figures: H100") pass; CB over twice
    the forward's noise, or a control inside the bound, fail and say which number broke it; the tolerance is a floor
    for the bound."""
    assert check_model.floor_verdict(4.8e-4, 5.3e-4, 29.0, 1e-4) is None  # Qwen2 std 0.2, fp32
    assert check_model.floor_verdict(2.79, 2.79, 31.0, 0.1) is None  # the same in bf16
    assert check_model.floor_verdict(2.3e-5, 1.8e-5, 8.7, 1e-4) is None  # Llama std 0.05, fp32: under tolerance
    assert check_model.floor_verdict(1.06e-3, 5.3e-4, 29.0, 1e-4) is None  # exactly on the bound
    broken = check_model.floor_verdict(1.07e-3, 5.3e-4, 29.0, 1e-4)
    assert broken is not None and broken.startswith("CB vs float64 max 1.07e-03 > bound 1.06e-03"), broken
    assert check_model.floor_verdict(2e-4, 1e-6, 29.0, 1e-4).startswith("CB vs float64")  # tolerance 1e-4 is the bound
    blind = check_model.floor_verdict(0.1, 0.5, 0.9, 0.1)
    assert blind is not None and blind.startswith("inconclusive: the control"), blind


def test_plain_fail_suggests_noise_floor_only_when_noise_could_explain_it():
    assert check_model._noise_could_explain(4e-4, torch.float32)
    assert not check_model._noise_could_explain(0.05, torch.float32)  # fp32 noise never came near this
    assert check_model._noise_could_explain(0.5, torch.bfloat16)  # bf16 noise reached 2.8 nats on sharp weights
