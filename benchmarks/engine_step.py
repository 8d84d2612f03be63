"""Per-step cost of the engine against `generate()` as rows grow: ms per decode step, µs per added row, and where a
step's time goes.

    python benchmarks/engine_step.py                          # null, tiny, small x 32/128/512/1024 rows, 2 cores
    python benchmarks/engine_step.py --quick                  # seconds, for smoke tests (not for numbers)
    python benchmarks/engine_step.py --models null --rows 32 512 --variant one_thread:OMP_NUM_THREADS=1
    python benchmarks/engine_step.py --models llama-1b --device cuda --rows 32 128 512 1024 --max-new-tokens 128
    python benchmarks/engine_step.py --models null tiny --rows 32 128 512 --profile-steps   # + CPU per step kind
    python benchmarks/engine_step.py --models tiny-qwen3.5 --rows 32 128   # Qwen3.5's hybrid layout (recurrent state)
    python benchmarks/engine_step.py --models qwen3.5-0.8b --device cuda --rows 32 128 512

Workload: `rows / --samples-per-prompt` random prompts of `--prompt-len` tokens, each sampled `--samples-per-prompt`
times (TRL repeats each prompt G times), no length tail: EOS is never sampled (`_model`, `--logit-scale`) so every
completion runs to `--max-new-tokens` (checked: a worker raises otherwise). Sampling at temperature 1, top_k 0,
top_p 1 (no logits processor on either side), fp32 on CPU (bf16 with `--device cuda`).

Models (random init, offline): `null` (1 layer x 32 wide: a forward costs next to nothing, so a step is framework
cost), `tiny` (2 x 64), `small` (8 x 256) and `tiny-qwen3.5` (4 x 64, Qwen3.5's 3:1 Gated DeltaNet / attention
layout) from `benchmarks/common.py`; `llama-1b` (Llama-3.2-1B at full size, its 128,256-entry vocabulary,
`common.llama_1b_random`) and `qwen3.5-0.8b` (Qwen3.5-0.8B's text layout, `common.qwen3_5_08b_random`) for a GPU.
On a GPU the phase timers measure host time (the kernels run asynchronously; a step's wall time is synchronized),
which is what decides a decode step there.

Backends, each (model, rows, backend) point in its own subprocess (`common.run_worker`), the backends interleaved
point by point so that load drift hits them alike:
- `generate`: one padded `model.generate` call over all rows, as TRL's default path.
- `trl_cb`: `ContinuousBatchingGenerator` (persistent engine, prefill shared per prompt, logprobs).
- `trl_cb:NAME`: the same with the environment of `--variant NAME:KEY=VALUE[,KEY=VALUE]` (an A/B of an environment
  setting, or of another checkout through `PYTHONPATH`), measured in the same run.

Measured per timed round (after one warm-up round that also builds the engine): wall time / max_new_tokens = ms per
decode step (one token for every row; the short prefill is included and the same for every backend), the process's
CPU time per step likewise (on a loaded machine the steadier measure: time other processes take is not counted; with
`--threads 1` it is the work done), and a profile:
wall-clock timers around the engine's phases, summed over the round and divided by the number of steps:
- trl_cb: `scheduling` (`prepare_next_batch`: the scheduler's per-request Python and the batch tensors),
  `sampling` (`ModelRunner._sample`), `attention` (trl_cb's varlen attention over all layers; `attention_planning`
  is the part of it spent building the per-batch plan), `forward` (the rest of the forward and logits processing),
  `bookkeeping` (`update_batch` and the step's host transfers), `other` (the rest of the round: submission,
  collection, thread hand-offs).
- generate: `forward` (outside attention), `attention` (sdpa), `sampling` (`torch.multinomial`), `other`.
With `--passes N` the whole interleaved sweep runs N times (each point's rounds pooled, its profile the median over
passes). With `--profile-steps`, trl_cb points also record the engine thread's CPU time per step kind (fast / upstream
decode / prefill) and phase (`step_profile.py`). Per-row cost (µs per row per step) is the slope of ms/step between
consecutive row counts. The JSON document is the last stdout line and is written under `--out` (default
runs/benchmarks/, git-ignored; cited results: `--out benchmarks/results`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import step_profile  # noqa: E402
from common import DEFAULT_OUT, OUT_HELP, environment, format_table, run_worker, write_json  # noqa: E402

MODELS = ("null", "tiny", "small", "llama-1b", "tiny-qwen3.5", "qwen3.5-0.8b")
CPU_MODELS = MODELS[:3]  # the default sweep (tiny-qwen3.5 on request)
BACKENDS = ("generate", "trl_cb")
TRL_CB_PHASES = ("scheduling", "sampling", "attention", "attention_planning", "forward", "bookkeeping", "other")
GENERATE_PHASES = ("sampling", "attention", "forward", "other")


# ------------------------------------------------------------------------------------------------------ worker


def _model(name: str, logit_scale: float, device: str = "cpu", dtype: str = "float32") -> tuple[Any, Any]:
    """A random model (untied LM head) that never samples EOS: the EOS row of the LM head is zero (logit 0) and the
    other rows are scaled so that the logits' spread is `logit_scale` (max logit ~3 x that over 512 tokens): P(EOS)
    ~ exp(-3 x logit_scale) per token. A step's cost does not depend on how peaked the distribution is."""
    import torch
    from common import cpu_preset, llama_1b_random, qwen3_5_08b_random

    from trl_cb.offline.tiny import tiny_model, tiny_tokenizer

    if name == "null":
        tokenizer = tiny_tokenizer()
        model = tiny_model(tokenizer, hidden_size=32, num_layers=1)
    elif name == "llama-1b":
        model, tokenizer = llama_1b_random(getattr(torch, dtype), device, None)
    elif name == "qwen3.5-0.8b":
        model, tokenizer = qwen3_5_08b_random(getattr(torch, dtype), device, None)
    else:
        model, tokenizer = cpu_preset(name, None)
    model.to(device=device, dtype=getattr(torch, dtype))
    with torch.no_grad():
        probe = torch.randint(3, len(tokenizer), (8, 32), generator=torch.Generator().manual_seed(0)).to(device)
        spread = float(model(input_ids=probe).logits.std())
        model.lm_head.weight.mul_(logit_scale / spread)
        model.lm_head.weight[tokenizer.eos_token_id] = 0.0
    return model, tokenizer


class PhaseTimer:
    """Wall-clock seconds per named phase: `wrap(obj, attr, phase)` times every call of `obj.attr`. Phases nest
    (attention inside the forward): each keeps its own total; the caller subtracts."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, obj: Any, attr: str, phase: str) -> None:
        original = getattr(obj, attr)
        totals, calls = self.totals, self.calls

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[phase] += time.perf_counter() - start
                calls[phase] += 1

        setattr(obj, attr, timed)

    def reset(self) -> None:
        self.totals.clear()
        self.calls.clear()


def _instrument_trl_cb(generator: Any, timer: PhaseTimer) -> None:
    """Time the engine's phases (transformers' batch processor and model runner, trl_cb's attention). Benchmark-only:
    it reaches the generator's engine through private attributes."""
    from trl_cb.engine import varlen_attention

    processor = generator._pool.engine.manager.batch_processor
    runner = processor.model_runner
    timer.wrap(processor, "prepare_next_batch", "scheduling")
    timer.wrap(processor, "update_batch", "update")
    timer.wrap(processor, "_generation_step", "step")
    timer.wrap(runner, "compute_batch", "compute")
    timer.wrap(runner, "_sample", "sampling")
    timer.wrap(varlen_attention, "packed_varlen_attention", "attention")
    timer.wrap(varlen_attention, "_plan", "attention_planning")


def _instrument_generate(timer: PhaseTimer) -> None:
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    timer.wrap(torch, "multinomial", "sampling")
    holder = type("Holder", (), {"sdpa": staticmethod(sdpa_attention_forward)})
    timer.wrap(holder, "sdpa", "attention")
    AttentionInterface.register("sdpa", holder.sdpa)


def _trl_cb_profile(totals: dict[str, float], steps: int, wall: float) -> dict[str, float]:
    ms = {k: 1000 * v / steps for k, v in totals.items()}
    attention = ms.get("attention", 0.0)
    return {
        "scheduling": ms.get("scheduling", 0.0),
        "sampling": ms.get("sampling", 0.0),
        "attention": attention,
        "attention_planning": ms.get("attention_planning", 0.0),
        "forward": ms.get("compute", 0.0) - ms.get("sampling", 0.0) - attention,
        "bookkeeping": ms.get("update", 0.0) + ms.get("step", 0.0) - ms.get("compute", 0.0),
        "other": 1000 * wall / steps - ms.get("scheduling", 0.0) - ms.get("step", 0.0) - ms.get("update", 0.0),
    }


def _generate_profile(totals: dict[str, float], steps: int, wall: float) -> dict[str, float]:
    ms = {k: 1000 * v / steps for k, v in totals.items()}
    forward = ms.get("forward", 0.0)
    return {
        "sampling": ms.get("sampling", 0.0),
        "attention": ms.get("attention", 0.0),
        "forward": forward - ms.get("attention", 0.0),
        "other": 1000 * wall / steps - forward - ms.get("sampling", 0.0),
    }


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One (model, rows, backend) point: a warm-up round, then `repeats` timed rounds."""
    import torch
    from transformers import GenerationConfig

    from trl_cb import ContinuousBatchingGenerator

    torch.set_num_threads(spec["threads"])
    device = spec["device"]
    model, tokenizer = _model(spec["model"], spec["logit_scale"], device, spec["dtype"])
    rows, group, new = spec["rows"], spec["samples_per_prompt"], spec["max_new_tokens"]
    prompts_per_round = rows // group
    gen_cfg = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    backend = spec["backend"]
    timer = PhaseTimer()
    generator = ContinuousBatchingGenerator(model, gen_cfg) if backend.startswith("trl_cb") else None
    steps = None  # step_profile.StepProfiler with --profile-steps (trl_cb only)
    if generator is None:
        timer.wrap(model, "forward", "forward")
        _instrument_generate(timer)
    rng = torch.Generator().manual_seed(spec["seed"])
    step_ms, cpu_step_ms, profiles, forwards = [], [], [], []
    for r in range(1 + spec["repeats"]):
        prompts = torch.randint(3, len(tokenizer), (prompts_per_round, spec["prompt_len"]), generator=rng).tolist()
        batch = [p for p in prompts for _ in range(group)]
        torch.manual_seed(spec["seed"] + r)
        timer.reset()
        if device != "cpu":
            torch.cuda.synchronize()
        cpu_start, start = time.process_time(), time.perf_counter()
        if generator is None:
            ids = torch.tensor(batch, device=device)
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)
            lengths = [len(row) for row in out[:, ids.shape[1] :].tolist() if tokenizer.eos_token_id not in row]
        else:
            lengths = [len(c) for c in generator.generate(batch, num_generations=1).completion_ids]
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if len(lengths) != rows or any(n != new for n in lengths):
            raise RuntimeError(
                f"{backend}: not every completion ran to {new} tokens (EOS sampled): raise --logit-scale"
            )
        if r == 0:
            if generator is not None:
                _instrument_trl_cb(generator, timer)
                steps = step_profile.StepProfiler(generator) if spec["profile_steps"] else None
            continue
        step_ms.append(1000 * wall / new)
        cpu_step_ms.append(1000 * cpu / new)
        profile = (_generate_profile if generator is None else _trl_cb_profile)(dict(timer.totals), new, wall)
        profiles.append(profile)
        forwards.append(timer.calls.get("compute" if generator else "forward", 0) / new)
    if generator is not None:
        generator.close()
    return {
        **({"step_profile": steps.summary(spec["repeats"])} if steps is not None else {}),
        "model": spec["model"],
        "rows": rows,
        "backend": backend,
        "step_ms": step_ms,
        "cpu_step_ms": cpu_step_ms,
        "profile_ms": {k: statistics.median(p[k] for p in profiles) for k in profiles[0]},
        "forwards_per_step": statistics.median(forwards),
        "threads": torch.get_num_threads(),
        "device": device,
        "dtype": spec["dtype"],
    }


# -------------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(CPU_MODELS), choices=MODELS, help="default: the CPU models")
    p.add_argument("--device", default="cpu", help="cpu (default) | cuda")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--rows", type=int, nargs="+", default=[32, 128, 512, 1024], help="rows (sequences) per round")
    p.add_argument("--samples-per-prompt", type=int, default=8, help="G: each prompt is sampled this many times")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per point (after one warm-up round)")
    p.add_argument("--passes", type=int, default=1, help="run the whole interleaved sweep this many times")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument(
        "--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="an extra trl_cb backend `trl_cb:NAME` run with these environment variables (repeatable)",
    )  # fmt: skip
    p.add_argument("--logit-scale", type=float, default=10.0, help="logit spread; EOS logit 0 (no length tail)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile-steps", action="store_true",
        help="record trl_cb's CPU time per step kind and phase (benchmarks/step_profile.py) as `step_profile`",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    p.add_argument("--quick", action="store_true", help="seconds-long smoke run (not for numbers)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return args
    if args.quick:
        args.models, args.rows, args.max_new_tokens, args.repeats = ["null"], [8, 16], 4, 1
        args.samples_per_prompt = 4
    for name, value in (("--samples-per-prompt", args.samples_per_prompt), ("--prompt-len", args.prompt_len),
                        ("--max-new-tokens", args.max_new_tokens), ("--repeats", args.repeats),
                        ("--passes", args.passes)):  # fmt: skip
        if value <= 0:
            p.error(f"{name} must be > 0, got {value}")
    bad = [r for r in args.rows if r <= 0 or r % args.samples_per_prompt]
    if bad:
        p.error(f"--rows must be positive multiples of --samples-per-prompt ({args.samples_per_prompt}), got {bad}")
    args.variants = {}
    for text in args.variant:
        name, _, assignments = text.partition(":")
        pairs = [a.partition("=") for a in assignments.split(",") if a]
        if not name or not pairs or any(not k or not sep for k, sep, _ in pairs):
            p.error(f"--variant must look like NAME:KEY=VALUE[,KEY=VALUE], got {text!r}")
        args.variants[name] = {k: v for k, _, v in pairs}
    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    if args.threads is None:
        import torch

        args.threads = torch.get_num_threads()
    return args


def _per_row_us(points: list[dict[str, Any]], key: str) -> dict[str, float]:
    """µs per added row per step (of `key`: wall or CPU ms per step) between consecutive row counts of one (model,
    backend)."""
    ordered = sorted(points, key=lambda p: p["rows"])
    return {
        f"{a['rows']}->{b['rows']}": 1000 * (b[key] - a[key]) / (b["rows"] - a["rows"])
        for a, b in zip(ordered, ordered[1:])
    }


def _run_point(args: argparse.Namespace, model: str, rows: int, backend: str) -> dict[str, Any]:
    """One worker process for (model, rows, backend), with the backend's variant environment."""
    spec = {
        "model": model, "rows": rows, "backend": backend, "samples_per_prompt": args.samples_per_prompt,
        "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "logit_scale": args.logit_scale, "threads": args.threads, "seed": args.seed, "device": args.device,
        "dtype": args.dtype, "profile_steps": args.profile_steps,
    }  # fmt: skip
    variant_env = args.variants.get(backend.partition(":")[2], {})
    saved = {k: os.environ.get(k) for k in variant_env}
    os.environ.update(variant_env)
    try:
        return run_worker(Path(__file__), spec, timeout=3600)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(json.loads(args.worker))))
        return {}
    backends = [*args.backends, *(f"trl_cb:{name}" for name in args.variants)]
    print(f"engine step sweep: models={args.models} rows={args.rows} backends={backends} threads={args.threads}")
    raw: list[dict[str, Any]] = []
    for _ in range(args.passes):  # each pass runs every point again: a slow spell of a loaded machine hits one pass
        for model in args.models:
            for rows in args.rows:
                for backend in backends:  # interleaved: every backend of a point runs back to back
                    raw.append(_run_point(args, model, rows, backend))
                    ms = statistics.median(raw[-1]["step_ms"])
                    print(f"  {model} rows={rows} {backend}: {ms:.2f} ms/step", flush=True)
    merged: dict[tuple[str, int, str], dict[str, Any]] = {}
    for r in raw:  # passes merged: every timed round's ms/step, the median profile over passes
        key = (r["model"], r["rows"], r["backend"])
        if key not in merged:
            merged[key] = {**r, "step_ms": [], "cpu_step_ms": [], "profiles": [], "step_profiles": []}
        merged[key]["step_ms"] += r["step_ms"]
        merged[key]["cpu_step_ms"] += r["cpu_step_ms"]
        merged[key]["profiles"].append(r["profile_ms"])
        if "step_profile" in r:
            merged[key]["step_profiles"].append(r["step_profile"])
    raw = list(merged.values())
    for r in raw:
        r["profile_ms"] = {k: statistics.median(p[k] for p in r["profiles"]) for k in r["profiles"][0]}
        if r["step_profiles"]:
            r["step_profile"] = step_profile.merge(r["step_profiles"])

    points = []
    for r in raw:
        base = next(x for x in raw if x["model"] == r["model"] and x["rows"] == r["rows"])  # the first backend
        ms, cpu_ms = statistics.median(r["step_ms"]), statistics.median(r["cpu_step_ms"])
        points.append(
            {
                **{k: r[k] for k in ("model", "rows", "backend", "profile_ms", "forwards_per_step", "threads")},
                **({"step_profile": r["step_profile"]} if "step_profile" in r else {}),
                "ms_per_step": ms,
                "ms_per_step_rounds": r["step_ms"],
                "cpu_ms_per_step": cpu_ms,
                "cpu_ms_per_step_rounds": r["cpu_step_ms"],
                "speed_vs_first_backend": statistics.median(base["step_ms"]) / ms,
                "cpu_speed_vs_first_backend": statistics.median(base["cpu_step_ms"]) / cpu_ms,
            }
        )
    per_row, cpu_per_row = (
        {
            f"{m}/{b}": _per_row_us([p for p in points if p["model"] == m and p["backend"] == b], key)
            for m in args.models
            for b in backends
        }
        for key in ("ms_per_step", "cpu_ms_per_step")
    )
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "worker"}
    payload = {
        "benchmark": "engine_step",
        "config": config,
        "env": {**environment("cpu"), "loadavg": os.getloadavg()},
        "points": points,
        "per_row_us": per_row,
        "cpu_per_row_us": cpu_per_row,
    }
    rows = [
        {
            "model": p["model"], "rows": p["rows"], "backend": p["backend"], "ms": p["ms_per_step"],
            "speed": p["speed_vs_first_backend"], "cpu": p["cpu_ms_per_step"],
            "cpu_speed": p["cpu_speed_vs_first_backend"], "fwd": p["forwards_per_step"],
            **{k: p["profile_ms"].get(k) for k in TRL_CB_PHASES},
        }
        for p in points
    ]  # fmt: skip
    columns = [("model", "model"), ("rows", "rows"), ("backend", "backend"), ("ms", "ms/step"),
               ("speed", f"speed vs {backends[0]}"), ("cpu", "cpu ms/step"), ("cpu_speed", "cpu speed"),
               ("fwd", "fwd/step")]  # fmt: skip
    columns += [(k, k.replace("attention_planning", "plan")) for k in TRL_CB_PHASES]
    print(format_table(rows, columns))
    if args.profile_steps:
        print(step_profile.format_profile(points))
    print("µs per added row per step (wall):", json.dumps(per_row))
    print("µs per added row per step (CPU):", json.dumps(cpu_per_row))
    path = write_json(payload, args.out, "engine_step")
    print(f"results: {path}")
    print(json.dumps(payload))
    return payload


if __name__ == "__main__":
    main()
