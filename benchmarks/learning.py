"""Learning benchmark: does RL through trl_cb learn, and how fast against wall-clock? GRPO and RLOO, reward curves
for plain `generate()`, trl_cb and trl_cb async, several seeds each.

    pip install -e . && python benchmarks/learning.py     # offline default: tiny Qwen2, CPU, ~5 min on 2 quiet cores
    python benchmarks/learning.py --quick                 # seconds: schema smoke test (learns nothing)
    python benchmarks/learning.py --trainers grpo --seeds 0 1 2 3 4 --steps 60
    python benchmarks/plot_learning.py runs/benchmarks/learning-YYYYmmdd-HHMMSS.json      # redraw the PNG
    # a real model, GSM8K accuracy as the reward (needs the hub and, to be practical, a GPU):
    python benchmarks/learning.py --model Qwen/Qwen2.5-0.5B-Instruct --reward gsm8k --device cuda \\
        --data-file gsm8k/train.jsonl --max-completion-length 256 --num-generations 8 --prompts-per-step 16 \\
        --learning-rate 1e-6 --steps 200 --threshold 0.5

Task (default): prompts are GSM8K test problems (shipped with trl_cb, chat-formatted); the reward is the share of one
character (`--char`, default "a") in the completion's text, dividing by at least `--min-chars` characters so that
stopping early never pays (`offline.data.char_share_reward`, also the offline recipes' reward). The tiny random model
(no EOS bias: completions run to the 24-token cap) starts near 0.04 and reaches 0.5-0.7 in 40 steps of 2 prompts x 8
samples at a constant learning rate of 5e-3 on every backend, so the benchmark finishes offline, while the curve
still depends on everything that matters for RL correctness: sampling, logprobs, IS correction, partial rollouts,
staleness. (With the throughput benchmarks' EOS bias of 4.0, or at lr 1e-2, one large update can teach the random
model to stop at once; all-empty groups carry no gradient and such a run never recovers, whatever the backend.)

On a shared machine, run with `OMP_NUM_THREADS=1`: two torch threads per process spin against other load and
stretch wall-clock unevenly. The JSON also records process CPU seconds per step, which a loaded machine disturbs less.

Backends, each (trainer, backend, seed) in its own subprocess with the same seed, data and hyper-parameters:
- `generate`:     TRL's trainer, `use_transformers_continuous_batching=False` (left-padded `model.generate`).
- `trl_cb`:       trl_cb's trainer with the flag on (persistent engine, IS-corrected loss).
- `trl_cb_async`: the same with `async_generation=True` (engine fed ahead of the trainer, bounded staleness).
- `trl_cb_server`: trl_cb's trainer on a local `trl-cb serve` replica the worker starts (`rollout_server_urls`; sync:
                  weights pushed before each step's generation). The cores are split: the server gets
                  `--server-threads` (default 1), the trainer the rest (at least 1).
- `trl_cb_server_async`: the same with `async_generation=True`: the server generates while the trainer trains.

Recorded every optimizer step: the mean reward of the batch trained on, wall-clock since `train()` began (engine
start-up included), samples trained on so far, and for async the staleness, dropped groups, trainer wait and engine
occupancy. Output: a table on stdout (time-to-threshold per backend and its ratio to generate()), a JSON file and a
PNG (reward vs wall-clock, reward vs samples; mean over seeds with a min-max band) under `--out` (default
runs/benchmarks/, git-ignored), and the JSON document as the last stdout line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    DEFAULT_OUT,
    OUT_HELP,
    environment,
    format_table,
    record_call_times,
    run_worker,
    served_model,
    write_json,
)

BACKENDS = ("generate", "trl_cb", "trl_cb_async", "trl_cb_server", "trl_cb_server_async")
#: Rollouts from a local `trl-cb serve` replica the worker starts (`--server-threads`; the trainer gets the rest).
SERVER_BACKENDS = ("trl_cb_server", "trl_cb_server_async")
TRAINERS = ("grpo", "rloo")
REWARDS = ("char", "gsm8k")


# ------------------------------------------------------------------------------------------------------ worker


def _model_and_tokenizer(spec: dict[str, Any]) -> tuple[Any, Any]:
    import torch

    from trl_cb.offline.tiny import tiny_model, tiny_tokenizer

    if spec["model"] == "tiny":
        tokenizer = tiny_tokenizer()
        return tiny_model(tokenizer, eos_logit_bias=spec["eos_logit_bias"], seed=spec["model_seed"]), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    dtype = getattr(torch, spec["dtype"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype, attn_implementation="sdpa")
    return model, tokenizer


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One (trainer, backend, seed) training run; returns its per-step curve."""
    import torch
    import trl

    import trl_cb

    kind, backend = spec["trainer"], spec["backend"]
    package = trl_cb if backend.startswith("trl_cb") else trl
    config_cls = package.GRPOConfig if kind == "grpo" else package.RLOOConfig
    trainer_cls = package.GRPOTrainer if kind == "grpo" else package.RLOOTrainer
    extra: dict[str, Any] = {}
    if backend != "generate":
        extra["use_transformers_continuous_batching"] = True
    if backend.endswith("_async"):
        extra.update(async_generation=True, max_staleness=spec["max_staleness"], prefetch_depth=spec["prefetch_depth"])
    model, tokenizer = _model_and_tokenizer(spec)
    with contextlib.ExitStack() as stack:
        if backend in SERVER_BACKENDS:
            device = spec.get("server_device") or spec["device"]
            served = served_model(model, tokenizer, spec["server_threads"], device, spec["dtype"])
            url = stack.enter_context(served)
            extra["rollout_server_urls"] = [url]
            torch.set_num_threads(max(1, (os.cpu_count() or 1) - spec["server_threads"]))
        return _train(spec, config_cls, trainer_cls, model, tokenizer, extra)


def _train(
    spec: dict[str, Any], config_cls: Any, trainer_cls: Any, model: Any, tokenizer: Any, extra: dict[str, Any]
) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback

    from trl_cb.offline.data import GSM8K_TEST_SIZE, char_share_reward, gsm8k_reward, gsm8k_test, load_gsm8k_jsonl

    kind, backend, cpu = spec["trainer"], spec["backend"], spec["device"] == "cpu"
    args = config_cls(
        output_dir=spec["output_dir"], per_device_train_batch_size=spec["prompts_per_step"] * spec["num_generations"],
        num_generations=spec["num_generations"], max_completion_length=spec["max_completion_length"],
        max_steps=spec["steps"], learning_rate=spec["learning_rate"], lr_scheduler_type="constant", beta=0.0,
        temperature=spec["temperature"], top_p=spec.get("top_p", 1.0), top_k=spec.get("top_k", 0),
        min_p=spec.get("min_p"), repetition_penalty=spec.get("repetition_penalty", 1.0),
        bf16=not cpu and spec["dtype"] == "bfloat16", use_cpu=cpu, report_to=[], save_strategy="no",
        logging_steps=1, disable_tqdm=True, seed=spec["seed"], data_seed=spec["seed"], **extra,
    )  # fmt: skip
    chat = tokenizer.chat_template is not None  # chat-formatted prompts unless the model has no template
    if spec["data_file"]:
        records = load_gsm8k_jsonl(spec["data_file"], limit=spec["num_prompts"], conversational=chat)
    else:
        records = gsm8k_test(min(spec["num_prompts"], GSM8K_TEST_SIZE), seed=spec["data_seed"], conversational=chat)
    dataset = Dataset.from_list(records)
    reward = gsm8k_reward if spec["reward"] == "gsm8k" else char_share_reward(spec["char"], spec["min_chars"])

    class Curve(TrainerCallback):
        """Wall-clock and process CPU time (all threads) at every optimizer step, from the start of `train()`.

        CPU time is recorded because a shared machine stretches wall-clock: with one torch thread
        (`OMP_NUM_THREADS=1`) the CPU seconds are close to what a quiet machine's wall-clock would be.
        """

        def __init__(self) -> None:
            self.start = self.cpu_start = 0.0
            self.step_end: list[float] = []
            self.cpu_end: list[float] = []

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.step_end.append(time.perf_counter() - self.start)
            self.cpu_end.append(time.process_time() - self.cpu_start)

    curve = Curve()
    trainer = trainer_cls(
        model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer,
        callbacks=[curve],
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # the per-step log dicts would bury the progress bar
    # The trainer's wait for rollouts each step: the generation call (sync backends) or the wait for finished groups
    # (async). The rest of a step is scoring, the IS / old-logprob forward, backward and the optimizer step.
    waits = record_call_times(trainer, "_cb_async_take" if backend.endswith("_async") else "_generate_single_turn")
    trainer.train()
    logs = [e for e in trainer.state.log_history if "reward" in e and "step" in e]
    if len(logs) != len(curve.step_end):
        raise RuntimeError(f"{len(logs)} reward logs for {len(curve.step_end)} steps: expected one per step")
    per_step = spec["prompts_per_step"] * spec["num_generations"]

    def series(name: str) -> list[float] | None:
        values = [e.get(name) for e in logs]
        return None if any(v is None for v in values) else [float(v) for v in values]

    return {
        "trainer": kind,
        "backend": backend,
        "seed": spec["seed"],
        "reward": [float(e["reward"]) for e in logs],
        "reward_std": series("reward_std"),
        "wall_clock_s": curve.step_end,
        "cpu_time_s": curve.cpu_end,
        "torch_threads": torch.get_num_threads(),
        "samples": [per_step * (i + 1) for i in range(len(logs))],
        "rollout_wait_s": waits,
        "completion_length": series("completions/mean_length"),
        "is_ratio_mean": series("sampling/importance_sampling_ratio/mean"),
        "async": {
            name: series(f"async/{name}")
            for name in (
                "staleness_mean",
                "staleness_max",
                "dropped_groups",
                "dropped_total",
                "wait_time_s",
                "engine_occupancy",
                "inflight_groups",
                "queue_depth",
                "policy_version",
            )
        }  # fmt: skip
        if backend.endswith("_async")
        else None,
    }


# ------------------------------------------------------------------------------------------------- aggregation


def _trailing_mean(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def first_crossing(values: list[float], threshold: float, window: int) -> int | None:
    """Index of the first step whose trailing mean over `window` steps reaches `threshold` (None if never)."""
    return next((i for i, v in enumerate(_trailing_mean(values, window)) if v >= threshold), None)


def _band(rows: list[list[float]]) -> dict[str, list[float]]:
    columns = list(zip(*rows))
    return {
        "mean": [statistics.fmean(c) for c in columns],
        "min": [min(c) for c in columns],
        "max": [max(c) for c in columns],
    }


def summarize_backend(runs: list[dict[str, Any]], threshold: float, window: int) -> dict[str, Any]:
    """Seed statistics of one (trainer, backend): mean/min/max curves, time and samples to threshold."""
    steps = min(len(r["reward"]) for r in runs)
    reward = _band([r["reward"][:steps] for r in runs])
    wall = _band([r["wall_clock_s"][:steps] for r in runs])
    cpu = _band([r["cpu_time_s"][:steps] for r in runs])
    samples = runs[0]["samples"][:steps]
    crossing = first_crossing(reward["mean"], threshold, window)
    per_seed = [first_crossing(r["reward"][:steps], threshold, window) for r in runs]
    step_times = [b - a for r in runs for a, b in zip([0.0, *r["wall_clock_s"]], r["wall_clock_s"])]
    waits = [w for r in runs for w in r["rollout_wait_s"]]
    out: dict[str, Any] = {
        "trainer": runs[0]["trainer"],
        "backend": runs[0]["backend"],
        "seeds": [r["seed"] for r in runs],
        "steps": steps,
        "reward": reward,
        "wall_clock_s": wall,
        "cpu_time_s": cpu,
        "samples": samples,
        "final_reward": {  # mean of each seed's last `window` steps
            "mean": statistics.fmean(statistics.fmean(r["reward"][steps - window : steps]) for r in runs),
            "min": min(statistics.fmean(r["reward"][steps - window : steps]) for r in runs),
            "max": max(statistics.fmean(r["reward"][steps - window : steps]) for r in runs),
        },
        "steps_to_threshold": None if crossing is None else crossing + 1,
        "time_to_threshold_s": None if crossing is None else wall["mean"][crossing],
        "cpu_time_to_threshold_s": None if crossing is None else cpu["mean"][crossing],
        "samples_to_threshold": None if crossing is None else samples[crossing],
        "time_to_threshold_per_seed_s": [None if i is None else r["wall_clock_s"][i] for r, i in zip(runs, per_seed)],
        "seeds_reaching_threshold": sum(i is not None for i in per_seed),
        "step_time_s": statistics.fmean(step_times),
        "cpu_time_per_step_s": statistics.fmean(r["cpu_time_s"][steps - 1] / steps for r in runs),
        "rollout_wait_s": statistics.fmean(waits) if waits else None,
        "total_wall_clock_s": statistics.fmean(r["wall_clock_s"][steps - 1] for r in runs),
        "mean_completion_length": statistics.fmean(x for r in runs for x in (r["completion_length"] or [0.0])),
        "async": None,
    }
    if runs[0]["async"] is not None:
        out["async"] = {
            "dropped_groups_total": [int(r["async"]["dropped_total"][-1]) for r in runs],
            # steps whose batch held at least one group sampled (partly) by an older policy, per seed
            "steps_with_stale_groups": [sum(1 for x in r["async"]["staleness_max"] if x > 0) for r in runs],
            "staleness_mean": statistics.fmean(x for r in runs for x in r["async"]["staleness_mean"]),
            "staleness_max": max(x for r in runs for x in r["async"]["staleness_max"]),
            "wait_time_s": statistics.fmean(x for r in runs for x in r["async"]["wait_time_s"]),
            "engine_occupancy": statistics.fmean(x for r in runs for x in r["async"]["engine_occupancy"]),
        }
    return out


def _in_band(curve: list[float], band: dict[str, list[float]], slack: float) -> float:
    """Share of steps where `curve` lies inside the [min - slack, max + slack] band."""
    n = min(len(curve), len(band["min"]))
    inside = sum(band["min"][i] - slack <= curve[i] <= band["max"][i] + slack for i in range(n))
    return inside / max(n, 1)


def targets(summary: list[dict[str, Any]], band_share: float) -> list[dict[str, Any]]:
    """The issue's targets, per trainer: ratios and band checks, each with the measured value and a verdict."""
    out = []
    for kind in sorted({s["trainer"] for s in summary}, key=TRAINERS.index):
        by = {s["backend"]: s for s in summary if s["trainer"] == kind}
        gen, sync, asy = by.get("generate"), by.get("trl_cb"), by.get("trl_cb_async")
        served, served_async = by.get("trl_cb_server"), by.get("trl_cb_server_async")

        def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str = "time_to_threshold_s") -> Any:
            if a is None or b is None or a[key] is None or not b[key]:
                return None
            return a[key] / b[key]

        checks: list[tuple[str, float | None, str, float]] = []
        if gen and sync:
            checks.append(("trl_cb sync reward-vs-samples inside generate()'s seed band (share of steps)",
                           _in_band(sync["reward"]["mean"], gen["reward"], 0.0), ">=", band_share))  # fmt: skip
        if sync and asy:
            checks.append(("trl_cb async reward-vs-samples inside sync's seed band (share of steps)",
                           _in_band(asy["reward"]["mean"], sync["reward"], 0.0), ">=", band_share))  # fmt: skip
            checks.append(("trl_cb async time-to-threshold / trl_cb sync", ratio(asy, sync), "<=", 0.75))
        if gen and asy:
            checks.append(("trl_cb async time-to-threshold / generate()", ratio(asy, gen), "<=", 0.6))
        if gen and sync:
            checks.append(("trl_cb sync time-to-threshold / generate() (no target)", ratio(sync, gen), "", 0.0))
        if sync and served_async:
            share = _in_band(served_async["reward"]["mean"], sync["reward"], 0.0)
            checks.append(("server async reward-vs-samples inside trl_cb sync's seed band", share, ">=", band_share))
            checks.append(("server async time-to-threshold / trl_cb sync", ratio(served_async, sync), "<=", 0.6))
        if sync and served:
            checks.append(("server sync time-to-threshold / trl_cb sync (no target)", ratio(served, sync), "", 0.0))
        cpu = "cpu_time_to_threshold_s"
        if sync and asy:
            checks.append(("same in process CPU seconds: async / sync", ratio(asy, sync, cpu), "", 0.0))
        if gen and asy:
            checks.append(("same in process CPU seconds: async / generate()", ratio(asy, gen, cpu), "", 0.0))
        for name, value, op, bound in checks:
            met = None if value is None or not op else (value >= bound if op == ">=" else value <= bound)
            out.append({"trainer": kind, "target": name, "value": value, "bound": f"{op} {bound}" if op else None,
                        "met": met})  # fmt: skip
    return out


# -------------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainers", nargs="+", default=list(TRAINERS), help=f"subset of {TRAINERS}")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), help=f"subset of {BACKENDS}")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds (sampling, data order)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=24)
    p.add_argument("--learning-rate", type=float, default=5e-3, help="constant schedule")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (TRL's top_p)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (TRL's top_k; 0: off)")
    p.add_argument("--min-p", type=float, default=None, help="min-p sampling (TRL's min_p)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="TRL's repetition_penalty")
    p.add_argument("--reward", default="char", choices=REWARDS, help="char: share of --char; gsm8k: accuracy")
    p.add_argument("--char", default="a", help="the character whose share is the reward (--reward char)")
    p.add_argument("--min-chars", type=int, default=20, help="--reward char: divide by at least this many chars")
    p.add_argument("--threshold", type=float, default=0.4, help="reward for the time-to-threshold table")
    p.add_argument("--window", type=int, default=3, help="trailing mean (steps) used to find the crossing")
    p.add_argument("--model", default="tiny", help="tiny (offline random Qwen2) | hub id | local path")
    p.add_argument("--device", default="auto", help="cpu | cuda | auto (default)")
    p.add_argument("--dtype", default=None, help="real models: float32 | bfloat16 (default: bf16 on GPU)")
    p.add_argument("--eos-logit-bias", type=float, default=None, help="tiny model: EOS logit boost (default none)")
    p.add_argument("--num-prompts", type=int, default=512, help="GSM8K problems in the training set")
    p.add_argument("--data-file", default=None, help="GSM8K JSONL to train on (e.g. the train split); default: the "
                   "GSM8K test split shipped with trl_cb")  # fmt: skip
    p.add_argument("--max-staleness", type=int, default=2, help="trl_cb_async: max_staleness")
    p.add_argument("--prefetch-depth", type=int, default=1, help="trl_cb_async: prefetch_depth")
    p.add_argument("--server-threads", type=int, default=1, help="server backends: the local server's threads")
    p.add_argument("--server-device", default=None, help="server backends: the server's device (default: --device)")
    p.add_argument("--band-share", type=float, default=0.8, help="share of steps that must lie inside a seed band")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    p.add_argument("--quick", action="store_true", help="3 steps of a tiny workload, 2 seeds at most: smoke test")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return args
    if args.quick:
        args.steps, args.seeds, args.prompts_per_step, args.num_generations = 3, args.seeds[:2], 2, 2
        args.max_completion_length, args.window = 8, 1
    for flag, allowed, given in (("--trainers", TRAINERS, args.trainers), ("--backends", BACKENDS, args.backends)):
        unknown = sorted(set(given) - set(allowed))
        if unknown:
            p.error(f"unknown {flag} value(s) {unknown}; choose from {list(allowed)}")
    for flag in ("steps", "prompts_per_step", "num_generations", "max_completion_length", "window", "num_prompts"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.data_file is not None and not Path(args.data_file).is_file():
        p.error(f"--data-file not found: {args.data_file}")
    if args.window > args.steps:
        p.error(f"--window ({args.window}) must be <= --steps ({args.steps})")
    if len(args.char) != 1:
        p.error(f"--char must be one character, got {args.char!r}")
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds must be distinct, got {args.seeds}")
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") and args.model != "tiny" else "float32"
    return args


def _print_tables(summary: list[dict[str, Any]], checks: list[dict[str, Any]], threshold: float) -> None:
    rows = []
    for s in summary:
        gen = next((x for x in summary if x["trainer"] == s["trainer"] and x["backend"] == "generate"), None)
        ratio = None
        if gen and gen["time_to_threshold_s"] and s["time_to_threshold_s"] is not None:
            ratio = s["time_to_threshold_s"] / gen["time_to_threshold_s"]
        a = s["async"] or {}
        rows.append({
            "trainer": s["trainer"], "backend": s["backend"], "final": s["final_reward"]["mean"],
            "band": f"{s['final_reward']['min']:.2f}-{s['final_reward']['max']:.2f}",
            "ttt": s["time_to_threshold_s"], "ratio": ratio, "stt": s["samples_to_threshold"],
            "reached": f"{s['seeds_reaching_threshold']}/{len(s['seeds'])}", "step": s["step_time_s"],
            "cpu": s["cpu_time_to_threshold_s"], "cpu_step": s["cpu_time_per_step_s"],
            "wait": s["rollout_wait_s"], "len": s["mean_completion_length"],
            "dropped": sum(a["dropped_groups_total"]) if a else None, "stale": a.get("staleness_mean"),
            "occ": a.get("engine_occupancy"),
        })  # fmt: skip
    print(format_table(rows, [
        ("trainer", "trainer"), ("backend", "backend"), ("final", "final reward"), ("band", "seed band"),
        ("ttt", f"s to {threshold}"), ("ratio", "x generate"), ("stt", "samples to"), ("reached", "seeds reached"),
        ("cpu", "CPU s to"), ("step", "s/step"), ("cpu_step", "CPU s/step"), ("wait", "rollout wait s/step"),
        ("len", "mean len"), ("dropped", "dropped groups"), ("stale", "mean staleness"), ("occ", "engine occupancy"),
    ]))  # fmt: skip
    print()
    print(format_table(
        [{"trainer": c["trainer"], "target": c["target"], "value": c["value"], "bound": c["bound"],
          "met": {True: "yes", False: "NO", None: "-"}[c["met"]]} for c in checks],
        [("trainer", "trainer"), ("target", "target"), ("value", "measured"), ("bound", "target"), ("met", "met")],
    ))  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(json.loads(args.worker))))
        return {}
    from plot_learning import render
    from tqdm import tqdm

    default_run = args.model == "tiny" and args.device == "cpu" and not args.quick
    print(
        f"trl_cb learning benchmark: trainers={args.trainers} backends={args.backends} seeds={args.seeds} "
        f"steps={args.steps} batch={args.prompts_per_step}x{args.num_generations} "
        f"max_completion_length={args.max_completion_length} reward={args.reward}"
        + (f"({args.char!r})" if args.reward == "char" else "")
        + (" — about 5 minutes on 2 quiet CPU cores (up to 15 when busy)." if default_run else ""),
        flush=True,
    )
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "worker"}
    # Backends alternate within each seed, so a slow phase of a shared machine hits all of them alike.
    runs_todo = [(t, s, b) for t in args.trainers for s in args.seeds for b in args.backends]
    runs: list[dict[str, Any]] = []
    bar = tqdm(runs_todo, desc="training runs", unit="run")
    for kind, seed, backend in bar:
        bar.set_postfix_str(f"{kind} {backend} seed {seed}")
        spec = {
            "trainer": kind, "backend": backend, "seed": seed, "steps": args.steps,
            "prompts_per_step": args.prompts_per_step, "num_generations": args.num_generations,
            "max_completion_length": args.max_completion_length, "learning_rate": args.learning_rate,
            "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
            "repetition_penalty": args.repetition_penalty, "device": args.device, "dtype": args.dtype,
            "model": args.model,
            "eos_logit_bias": args.eos_logit_bias, "model_seed": 0, "num_prompts": args.num_prompts,
            "data_seed": 0, "data_file": args.data_file, "reward": args.reward, "char": args.char,
            "min_chars": args.min_chars, "max_staleness": args.max_staleness,
            "prefetch_depth": args.prefetch_depth, "server_threads": args.server_threads,
            "server_device": args.server_device,
            "output_dir": f"/tmp/trl_cb_learning_{kind}_{backend}_{seed}",
        }  # fmt: skip
        runs.append(run_worker(Path(__file__), spec, timeout=3600))
    bar.close()

    summary = [
        summarize_backend([r for r in runs if r["trainer"] == t and r["backend"] == b], args.threshold, args.window)
        for t in args.trainers
        for b in args.backends
    ]
    checks = targets(summary, args.band_share)
    payload = {
        "benchmark": "learning",
        "config": config,
        "env": environment(args.device),
        "summary": summary,
        "targets": checks,
        "runs": runs,
    }
    _print_tables(summary, checks, args.threshold)
    json_path = write_json(payload, args.out, "learning")
    png_path = render(json_path, json_path.with_suffix(".png"))
    print(f"results: {json_path}\nplot: {png_path}")
    print(json.dumps(payload))
    return payload


if __name__ == "__main__":
    main()
