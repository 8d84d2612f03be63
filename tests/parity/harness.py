"""Run the same training twice — trl_cb's trainer with CB on, and TRL's own trainer on its `generate()` path — and
compare what TRL logs.

Two ways to make the two runs see the same completions:
- Replay (stochastic policy): the CB run samples; every completion list it produced is handed, in order, to TRL's run
  through its `model.generate` (the way TRL's own tests script generation). The prompts TRL asks for are checked
  against the ones CB was given, so both runs must also agree on batching, repetition and order. Everything
  downstream — rewards, advantages, loss, gradient norm — must then agree; the only difference is trl_cb's IS
  weight, which is 1 up to fp32 noise here (same weights, top_k=0, top_p=1).
- Scripted policy (tools, environments): a model whose next token is a fixed function of the last one, so both runs
  *generate* the same tool calls for real.

The CB run's sampling is wrapped in `fork_rng`, so it leaves the global RNG where TRL's run (which samples nothing)
leaves it: shuffles that TRL draws from the global RNG (`steps_per_generation > 1`) agree too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import trl
from datasets import Dataset

import trl_cb

#: Metrics that legitimately differ between runs (time, throughput) or exist on one side only.
IGNORED = ("runtime", "per_second", "step_time", "epoch", "timing", "profiling")

PAIRS = {
    "grpo": (trl_cb.GRPOConfig, trl_cb.GRPOTrainer, trl.GRPOConfig, trl.GRPOTrainer),
    "rloo": (trl_cb.RLOOConfig, trl_cb.RLOOTrainer, trl.RLOOConfig, trl.RLOOTrainer),
}

BASE_ARGS: dict[str, Any] = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    max_steps=1,
    logging_steps=1,
    learning_rate=0.0,
    report_to=[],
    save_strategy="no",
    use_cpu=True,
    disable_tqdm=True,
    bf16=False,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    seed=7,
)


@dataclass
class Run:
    """One finished training run: its trainer, its per-step log entries and the completions it generated."""

    trainer: Any
    logs: list[dict[str, float]]
    completions: list[list[list[int]]] = field(default_factory=list)  # per generation call
    prompts: list[list[list[int]]] = field(default_factory=list)


def make_args(config_cls: type, tmp_path: Path, name: str, **overrides: Any) -> Any:
    kwargs = dict(BASE_ARGS, output_dir=str(tmp_path / name))
    kwargs.update(overrides)
    return config_cls(**kwargs)


def run_cb(
    kind: str,
    tmp_path: Path,
    model_fn: Callable[[], Any],
    args: dict[str, Any],
    setup: Callable[[Any], None] | None = None,
    **trainer_kwargs: Any,
) -> Run:
    """trl_cb's trainer with continuous batching on; records every generation call's prompts and completions.
    `setup(trainer)` runs before training (to attach probes)."""
    config_cls, trainer_cls, _, _ = PAIRS[kind]
    torch.manual_seed(0)  # identical PEFT / reward-model init in both runs
    trainer = trainer_cls(
        model=model_fn(),
        args=make_args(config_cls, tmp_path, "cb", use_transformers_continuous_batching=True, **args),
        **trainer_kwargs,
    )
    run = Run(trainer=trainer, logs=[])
    real = trainer.rollouts.generate

    def recording_generate(prompt_ids: list[list[int]]) -> Any:
        with torch.random.fork_rng(devices=[]):
            completion_ids, logprobs = real(prompt_ids)
        run.prompts.append([list(p) for p in prompt_ids])
        run.completions.append([list(c) for c in completion_ids])
        return completion_ids, logprobs

    trainer.rollouts.generate = recording_generate
    if setup is not None:
        setup(trainer)
    trainer.train()
    run.logs = step_logs(trainer)
    return run


def run_trl(
    kind: str,
    tmp_path: Path,
    model_fn: Callable[[], Any],
    args: dict[str, Any],
    replay: Run | None = None,
    **trainer_kwargs: Any,
) -> Run:
    """TRL's own trainer on its `generate()` path; with `replay`, `model.generate` returns the CB run's completions."""
    _, _, config_cls, trainer_cls = PAIRS[kind]
    torch.manual_seed(0)
    trainer = trainer_cls(model=model_fn(), args=make_args(config_cls, tmp_path, "trl", **args), **trainer_kwargs)
    run = Run(trainer=trainer, logs=[])
    if replay is not None:
        _script_generate(trainer, replay, run)
    trainer.train()
    run.logs = step_logs(trainer)
    if replay is not None:
        assert len(run.completions) == len(replay.completions), "TRL made a different number of generation calls"
    return run


def _script_generate(trainer: Any, replay: Run, run: Run) -> None:
    pad_id = trainer.processing_class.pad_token_id
    model = trainer.model

    def fake_generate(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        call = len(run.completions)
        assert call < len(replay.completions), "TRL asked for more generations than the CB run made"
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        prompts = [ids[m.bool()].tolist() for ids, m in zip(input_ids, mask, strict=True)]
        assert prompts == replay.prompts[call], f"generation call {call}: TRL's prompts differ from CB's"
        completions = replay.completions[call]
        run.prompts.append(prompts)
        run.completions.append(completions)
        width = max(1, max(len(c) for c in completions))
        padded = torch.full((len(completions), width), pad_id, dtype=input_ids.dtype, device=input_ids.device)
        for i, c in enumerate(completions):
            padded[i, : len(c)] = torch.tensor(c, dtype=input_ids.dtype)
        return torch.cat([input_ids, padded], dim=1)

    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    target.generate = fake_generate  # instance attribute: what `unwrap_model_for_generation` hands TRL
    if target is not model:
        model.generate = fake_generate


def step_logs(trainer: Any) -> list[dict[str, float]]:
    """Per-step training log entries (those with a loss) and eval entries, in order."""
    return [e for e in trainer.state.log_history if "loss" in e or any(k.startswith("eval_") for k in e)]


def compared_keys(cb: dict[str, float], ref: dict[str, float]) -> list[str]:
    return sorted(k for k in set(cb) & set(ref) if not any(p in k for p in IGNORED))


def assert_same_logs(cb: Run, ref: Run, rel: float = 1e-3, abs_: float = 1e-5, required: tuple[str, ...] = ()) -> None:
    """Every metric both runs log agrees, step by step; TRL's metrics are all present and finite on the CB side."""
    assert len(cb.logs) == len(ref.logs) > 0, (len(cb.logs), len(ref.logs))
    for step, (a, b) in enumerate(zip(cb.logs, ref.logs, strict=True)):
        missing = set(b) - set(a)
        assert not missing, f"step {step}: TRL logs {sorted(missing)}, the CB run does not"
        for name in required:
            assert name in a, f"step {step}: {name} not logged"
        for key in compared_keys(a, b):
            x, y = a[key], b[key]
            if isinstance(y, float) and math.isnan(y):
                assert math.isnan(x), f"step {step} {key}: CB {x} vs TRL nan"
                continue
            assert math.isclose(x, y, rel_tol=rel, abs_tol=abs_), f"step {step} {key}: CB {x} vs TRL {y}"


def assert_finite(run: Run, names: tuple[str, ...]) -> None:
    for step, entry in enumerate(run.logs):
        for name in names:
            assert name in entry and math.isfinite(entry[name]), f"step {step}: {name}={entry.get(name)}"


def prompt_dataset(n: int = 8, seed: int = 5, conversational: bool = False) -> Dataset:
    from trl_cb.offline.data import synthetic_gsm8k

    rows = synthetic_gsm8k(n, seed=seed)
    if conversational:
        rows = [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows]
    return Dataset.from_list(rows)
