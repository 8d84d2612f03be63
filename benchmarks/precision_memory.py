"""Precision memory benchmark: host memory (RSS) of GRPO training with bf16 generation, per backend and mode.

    pip install -e . && python benchmarks/precision_memory.py          # ~63 M-parameter Qwen2, CPU, ~10 minutes
    python benchmarks/precision_memory.py --quick                      # 2-layer model, smoke test (~1 minute)
    python benchmarks/precision_memory.py --cases fp32-bf16 --backends generate trl_cb

What it answers: how much memory trl_cb's bf16/fp16 generation copies (`trl_cb/engine/precision.py`) cost, kept between
rounds (`cb_keep_generation_weights` unset or `True`) or made per round (`False`), against TRL's own `generate()`
path (CB flag off: no copy, generation under accelerate's autocast).

Cases (`--cases`):
- `fp32-bf16`: model loaded in fp32, `bf16=True` (TRL's defaults): trl_cb generates on bf16 copies.
- `bf16-bf16`: model loaded in bf16 (`torch_dtype=torch.bfloat16`), `bf16=True`: nothing to copy.
- `fp32-fp32`: model in fp32, `bf16=False`: no cast anywhere (reference).

Backends (`--backends`): `generate` (TRL's trainer, flag off), `trl_cb` (sync), `trl_cb_async`
(`cb_async_generation=True`); the trl_cb ones run once per `--keep` value that applies (`auto`, `false`, `true`;
only where a copy is made, i.e. `fp32-bf16`).

Each (case, backend, keep) runs in a fresh subprocess (benchmarks/common.py `run_worker`), so peaks do not mix. In it:
- `rss_ready`: VmRSS once the trainer is built (model, tokenizer, dataset, imports).
- `peak_train`: VmHWM over `trainer.train()` only (reset through `/proc/self/clear_refs` just before, so building a
  bf16 model from an fp32 init does not count); falls back to `ru_maxrss` (whole process) where the reset is refused.
- `held_between_steps`: the largest VmRSS at the end of a step (after the optimizer step, before the next round),
  after `gc.collect()` and glibc `malloc_trim(0)`, so freed memory the allocator kept does not count: the memory
  held outside generation rounds.
- `copy_kept_mib`: bytes of generation copies the generator holds at the end of a step (`copy_bytes`), and
  `copy_round_mib`: bytes of the module's tensors pointed at copies during a round (kept or made for it).
Reported in MiB, and as deltas against the `generate` backend of the same case.

Model: Qwen2 random init from a config (`--hidden-size`, `--layers`, `--intermediate-size`; default 512 x 16, MLP
2048, 512-token vocabulary: ~63 M parameters, 240 MiB in fp32), never downloaded. Table on stdout, JSON under
`--out` (default `runs/benchmarks/`, git-ignored), JSON as the last line.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DEFAULT_OUT, OUT_HELP, environment, format_table, run_worker, write_json  # noqa: E402

CASES = ("fp32-bf16", "bf16-bf16", "fp32-fp32")
BACKENDS = ("generate", "trl_cb", "trl_cb_async")
KEEPS = ("auto", "false", "true")
MIB = 2**20


# ------------------------------------------------------------------------------------------------ memory probes


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux `clear_refs` 5). False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_bytes(reset_ok: bool) -> int:
    hwm = _status_kib("VmHWM") if reset_ok else None
    if hwm is not None:
        return hwm * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def live_rss_bytes() -> int:
    """VmRSS after returning freed memory: what the process holds, not what its allocator cached."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return (_status_kib("VmRSS") or 0) * 1024


# ------------------------------------------------------------------------------------------------------- worker


def _generators(trainer: Any) -> list[Any]:
    state = getattr(trainer, "rollout_state", None)  # a plain TRL trainer (`generate`) has none
    if state is None:
        return []
    gens = [state.generator]
    controller = state.async_rollouts.source
    gens.append(getattr(controller, "generator", None))
    return [g for g in gens if g is not None]


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    import trl_cb
    from trl_cb.engine.precision import GenerationPrecision
    from trl_cb.offline.data import gsm8k_test
    from trl_cb.offline.tiny import tiny_model, tiny_tokenizer

    model_dtype, train_precision = spec["case"].split("-")
    backend = spec["backend"]
    package = trl_cb if backend.startswith("trl_cb") else trl
    extra: dict[str, Any] = {}
    if backend.startswith("trl_cb"):
        extra["cb_keep_generation_weights"] = {"auto": None, "true": True, "false": False}[spec["keep"]]
    if backend == "trl_cb_async":
        extra["cb_async_generation"] = True
    args = package.GRPOConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=spec["prompts"] * spec["num_generations"],
        num_generations=spec["num_generations"], max_completion_length=spec["max_completion_length"],
        max_steps=spec["steps"], learning_rate=1e-5, beta=0.0, bf16=train_precision == "bf16", use_cpu=True,
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0, top_k=0, top_p=1.0,
        use_transformers_continuous_batching=backend != "generate", **extra,
    )  # fmt: skip
    tokenizer = tiny_tokenizer()
    model = tiny_model(
        tokenizer, hidden_size=spec["hidden_size"], num_layers=spec["layers"],
        num_attention_heads=spec["hidden_size"] // 64, intermediate_size=spec["intermediate_size"],
        eos_logit_bias=spec["eos_logit_bias"], dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[model_dtype],
    )  # fmt: skip
    num_params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    dataset = Dataset.from_list(gsm8k_test(spec["prompts"] * spec["steps"] * 4, seed=0))

    copies = {"kept": 0, "round": 0}
    real_applied = GenerationPrecision.applied

    @contextlib.contextmanager
    def measured_applied(self: GenerationPrecision, module: Any) -> Any:
        """The real `applied`; inside it, the bytes of every tensor pointed at a copy (its storage moved)."""
        tensors = [*module.parameters(), *module.buffers()]
        before = [t.data_ptr() for t in tensors]
        with real_applied(self, module):
            moved = sum(t.numel() * t.element_size() for t, ptr in zip(tensors, before) if t.data_ptr() != ptr)
            copies["round"] = max(copies["round"], moved)
            yield

    GenerationPrecision.applied = measured_applied  # type: ignore[method-assign]

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.held: list[int] = []
            self.rounds: list[int] = []

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            copies["round"] = 0

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.held.append(live_rss_bytes())
            self.rounds.append(copies["round"])
            copies["kept"] = max([copies["kept"], *(g.generation_copy_bytes for g in _generators(trainer))])

    probe = Probe()

    def length_reward(completions: list[Any], **kwargs: Any) -> list[float]:
        return [len(c if isinstance(c, str) else c[-1]["content"]) / 100 for c in completions]

    trainer = package.GRPOTrainer(
        model=model, reward_funcs=length_reward, args=args, train_dataset=dataset, processing_class=tokenizer,
        callbacks=[probe],
    )  # fmt: skip
    del model
    rss_ready = live_rss_bytes()
    reset_ok = reset_peak()
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    peak = peak_bytes(reset_ok)
    params_after = {str(p.dtype) for p in trainer.model.parameters()}
    return {
        "case": spec["case"],
        "backend": backend,
        "keep": spec.get("keep"),
        "num_params": num_params,
        "weight_bytes": weight_bytes,
        "rss_ready": rss_ready,
        "peak_train": peak,
        "peak_is_reset": reset_ok,
        "held_between_steps": max(probe.held),
        "held_per_step": probe.held,
        "copy_kept_bytes": copies["kept"],
        "copy_round_bytes": max(probe.rounds),
        "param_dtypes_after": sorted(params_after),
        "train_seconds": seconds,
    }


# --------------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=list(CASES), help=f"subset of {CASES}")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), help=f"subset of {BACKENDS}")
    p.add_argument("--keep", nargs="+", default=["auto", "false"], help=f"cb_keep_generation_weights, of {KEEPS}")
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--intermediate-size", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="training steps (optimizer state exists from step 1 on)")
    p.add_argument("--eos-logit-bias", type=float, default=4.0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    p.add_argument("--quick", action="store_true", help="2-layer 128-wide model, 2 steps (smoke test)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return args
    if args.quick:
        args.hidden_size, args.layers, args.intermediate_size, args.steps = 128, 2, 256, 2
        args.max_completion_length = 8
    for name, allowed, given in (
        ("--cases", CASES, args.cases),
        ("--backends", BACKENDS, args.backends),
        ("--keep", KEEPS, args.keep),
    ):
        unknown = sorted(set(given) - set(allowed))
        if unknown:
            p.error(f"unknown {name} value(s) {unknown}; choose from {list(allowed)}")
    for name in ("hidden_size", "layers", "intermediate_size", "prompts", "num_generations", "steps"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.hidden_size % 64:
        p.error("--hidden-size must be a multiple of 64 (heads of 64)")
    return args


def runs_for(args: argparse.Namespace) -> list[tuple[str, str, str | None]]:
    runs = []
    for case in args.cases:
        for backend in args.backends:
            if backend == "generate":
                runs.append((case, backend, None))
            else:  # the keep setting only matters where a copy is made
                for keep in args.keep if case == "fp32-bf16" else ["auto"]:
                    runs.append((case, backend, keep))
    return runs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(json.loads(args.worker))))
        return {}
    runs = runs_for(args)
    print(
        f"trl_cb precision memory benchmark: {len(runs)} runs, Qwen2 {args.layers} x {args.hidden_size} "
        f"(MLP {args.intermediate_size}), {args.steps} GRPO steps of {args.prompts} prompts x "
        f"{args.num_generations} completions x {args.max_completion_length} tokens",
        flush=True,
    )
    results = []
    for i, (case, backend, keep) in enumerate(runs, 1):
        spec = {
            "case": case, "backend": backend, "keep": keep, "hidden_size": args.hidden_size, "layers": args.layers,
            "intermediate_size": args.intermediate_size, "prompts": args.prompts,
            "num_generations": args.num_generations, "max_completion_length": args.max_completion_length,
            "steps": args.steps, "eos_logit_bias": args.eos_logit_bias,
            "output_dir": f"/tmp/trl_cb_bench_precision_memory_{case}_{backend}",
        }  # fmt: skip
        print(f"[{i}/{len(runs)}] {case} {backend}{'' if keep is None else ' keep=' + keep} ...", flush=True)
        t0 = time.perf_counter()
        r = run_worker(Path(__file__), spec, timeout=3600)
        print(
            f"    peak {r['peak_train'] / MIB:.0f} MiB, held {r['held_between_steps'] / MIB:.0f} MiB "
            f"({time.perf_counter() - t0:.0f}s)",
            flush=True,
        )
        results.append(r)

    points = []
    for r in results:
        base = next((x for x in results if x["case"] == r["case"] and x["backend"] == "generate"), None)
        points.append(
            {
                **{k: r[k] for k in ("case", "backend", "keep", "num_params", "param_dtypes_after", "peak_is_reset")},
                "weights_mib": r["weight_bytes"] / MIB,
                "rss_ready_mib": r["rss_ready"] / MIB,
                "peak_train_mib": r["peak_train"] / MIB,
                "held_between_steps_mib": r["held_between_steps"] / MIB,
                "held_per_step_mib": [b / MIB for b in r["held_per_step"]],
                "copy_kept_mib": r["copy_kept_bytes"] / MIB,
                "copy_round_mib": r["copy_round_bytes"] / MIB,
                "peak_vs_generate_mib": None if base is None else (r["peak_train"] - base["peak_train"]) / MIB,
                "held_vs_generate_mib": None
                if base is None
                else (r["held_between_steps"] - base["held_between_steps"]) / MIB,
                "train_seconds": r["train_seconds"],
            }
        )
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "worker"}
    payload = {"benchmark": "precision_memory", "config": config, "env": environment("cpu"), "points": points}
    rows = [{**p, "keep": p["keep"] or "-", "params_m": p["num_params"] / 1e6} for p in points]
    print(
        format_table(
            rows,
            [
                ("case", "model-train"),
                ("backend", "backend"),
                ("keep", "keep"),
                ("params_m", "params (M)"),
                ("weights_mib", "weights MiB"),
                ("rss_ready_mib", "ready MiB"),
                ("peak_train_mib", "peak MiB"),
                ("peak_vs_generate_mib", "peak - generate"),
                ("held_between_steps_mib", "held MiB"),
                ("held_vs_generate_mib", "held - generate"),
                ("copy_kept_mib", "kept copy MiB"),
                ("copy_round_mib", "round copy MiB"),
            ],
        )
    )
    path = write_json(payload, args.out, "precision_memory")
    print(f"results: {path}")
    print(json.dumps(payload))
    return payload


if __name__ == "__main__":
    main()
