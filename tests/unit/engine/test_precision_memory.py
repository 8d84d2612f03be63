"""`cb_keep_generation_weights` (issue 17): bf16/fp16 generation copies of the weights are kept between rounds, or
made and freed every round, as configured; the auto default keeps them unless the parameters are sharded.

Each test checks both sides: between rounds the generator holds the documented bytes (`copy_bytes`), and during the
round the engine still ran on generation-dtype copies (a per-round mode that simply stopped casting would fail)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from tests.conftest import sampling_config
from tests.unit.engine.test_precision import WeightDtypeSpy, q_proj
from tests.unit.trainers.test_trainers import make_trainer
from trl_cb import ContinuousBatchingGenerator, GRPOConfig, RLOOConfig
from trl_cb.engine import sharding
from trl_cb.engine.precision import GenerationPrecision
from trl_cb.offline.tiny import tiny_model


@contextlib.contextmanager
def moved_bytes_per_round():
    """Record, for every `GenerationPrecision.applied` round, the bytes of the tensors pointed at copies in it."""
    rounds: list[int] = []
    real = GenerationPrecision.applied

    @contextlib.contextmanager
    def measured(self, module):
        tensors = [*module.parameters(), *module.buffers()]
        before = [t.data_ptr() for t in tensors]
        with real(self, module):
            rounds.append(sum(t.numel() * t.element_size() for t, p in zip(tensors, before) if t.data_ptr() != p))
            yield

    GenerationPrecision.applied = measured
    try:
        yield rounds
    finally:
        GenerationPrecision.applied = real


def bf16_param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * 2 for p in model.parameters())


# ------------------------------------------------------------------------------------------------ generator level


@pytest.mark.parametrize(("keep", "kept"), [(None, True), (True, True), (False, False)], ids=str)
def test_generator_keeps_or_frees_copies_between_rounds(keep, kept, model, tokenizer, prompts):
    cfg = sampling_config(tokenizer, max_new_tokens=4)
    with moved_bytes_per_round() as rounds:
        gen = ContinuousBatchingGenerator(model, cfg, cast_dtype=torch.bfloat16, keep_generation_weights=keep)
        with gen:
            spy = WeightDtypeSpy(q_proj(model))
            held = []
            for _ in range(2):
                gen.generate(prompts[:2], num_generations=2)
                held.append(gen.generation_copy_bytes)
            spy.remove()
    assert {d for d, *_ in spy.seen} == {torch.bfloat16}, "rounds run on bf16 copies in every mode"
    assert len(rounds) == 2 and rounds[0] == rounds[1] >= bf16_param_bytes(model) // 2, rounds
    # Kept: the copies of the round stay allocated (exactly those bytes); per round: nothing is held between rounds.
    assert held == ([rounds[0]] * 2 if kept else [0, 0]), (held, rounds)
    assert gen.generation_copy_bytes == 0, "close frees kept copies"


@pytest.mark.parametrize(("keep", "kept"), [(None, False), (True, True), (False, False)], ids=str)
def test_sharded_default_makes_copies_per_round(keep, kept, model, tokenizer, prompts, monkeypatch):
    """Auto (None) with sharded parameters (ZeRO-3/FSDP, as `engine.sharding.is_sharded` reports them): per-round
    copies, since a kept one would be the full model on every rank; `True` forces keeping anyway."""
    monkeypatch.setattr(sharding, "is_sharded", lambda model, accelerator: True)
    cfg = sampling_config(tokenizer, max_new_tokens=4)
    with ContinuousBatchingGenerator(model, cfg, cast_dtype=torch.bfloat16, keep_generation_weights=keep) as gen:
        gen.generate(prompts[:1], num_generations=2)
        assert (gen.generation_copy_bytes >= bf16_param_bytes(model) // 2) is kept


def _live_rss() -> int:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_per_round_copies_lower_memory_held_between_rounds(tokenizer, prompts):
    """The documented cost, in resident memory: between rounds, keeping holds ~2 bytes per fp32 parameter more than
    per-round copies (model of ~17 M parameters: ~32 MiB of bf16 copies)."""
    model = tiny_model(tokenizer, hidden_size=256, num_layers=16, num_attention_heads=4, intermediate_size=1024)
    expected = bf16_param_bytes(model)
    cfg = sampling_config(tokenizer, max_new_tokens=2)
    held = {}
    for keep in (False, True, False):  # per-round measured before and after keeping: no drift mistaken for a copy
        with ContinuousBatchingGenerator(model, cfg, cast_dtype=torch.bfloat16, keep_generation_weights=keep) as gen:
            gen.generate(prompts[:1], num_generations=1)
            held.setdefault(keep, []).append(_live_rss())
    extra = held[True][0] - max(held[False])
    assert 0.7 * expected < extra < 1.3 * expected, (extra / 2**20, expected / 2**20, held)


# -------------------------------------------------------------------------------------------------- trainer level


class CopyBytesAtStepEnd(TrainerCallback):
    """`copy_bytes` of the trainer's generator(s) at the end of every step (after the optimizer step)."""

    def __init__(self) -> None:
        self.trainer = None
        self.held: list[int] = []

    def on_step_end(self, *args, **kwargs) -> None:
        controller = self.trainer.rollouts.async_rollouts.source
        gens = [self.trainer.rollouts.generator, getattr(controller, "generator", None)]
        self.held.append(sum(g.generation_copy_bytes for g in gens if g is not None))


@pytest.mark.parametrize(
    ("cb_async_generation", "keep", "kept"),
    [(False, None, True), (False, False, False), (True, None, True), (True, False, False)],
    ids=["sync-auto", "sync-false", "async-auto", "async-false"],
)
def test_trainer_option_reaches_generation_copies(cb_async_generation, keep, kept, tokenizer, tmp_path):
    trainer = make_trainer(
        "grpo", tokenizer, tmp_path, bf16=True, max_steps=2, per_device_train_batch_size=4, max_completion_length=8,
        cb_async_generation=cb_async_generation, cb_keep_generation_weights=keep,
    )  # fmt: skip
    probe = CopyBytesAtStepEnd()
    probe.trainer = trainer
    trainer.add_callback(probe)
    with moved_bytes_per_round() as rounds:
        trainer.train()
    assert rounds and all(r >= bf16_param_bytes(trainer.model) // 2 for r in rounds), "rounds ran on bf16 copies"
    assert len(probe.held) == 2
    assert all((h == rounds[0]) if kept else (h == 0) for h in probe.held), (probe.held, rounds)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


# ------------------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("cls", [GRPOConfig, RLOOConfig])
def test_config_field_default_validation_and_cli(cls):
    from trl import TrlParser

    base = dict(output_dir="/tmp/trl_cb_test", report_to=[], use_cpu=True)
    assert cls(**base).cb_keep_generation_weights is None
    assert cls(**base, cb_keep_generation_weights=False).cb_keep_generation_weights is False
    with pytest.raises(TypeError, match="cb_keep_generation_weights must be bool or None"):
        cls(**base, cb_keep_generation_weights="no")
    (cfg,) = TrlParser((cls,)).parse_args_and_config(
        ["--output_dir", "/tmp/x", "--use_cpu", "--report_to", "none", "--cb_keep_generation_weights", "false"]
    )
    assert cfg.cb_keep_generation_weights is False
