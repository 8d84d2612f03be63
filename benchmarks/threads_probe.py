"""Why trl_cb holds an OpenMP guard thread: time one training forward+backward under each OpenMP wait condition.

    python benchmarks/threads_probe.py                                   # tiny, quiet and 2 busy processes, 3 rounds
    python benchmarks/threads_probe.py --model small --rounds 2 --background-load 0 2

Conditions, each in a fresh interpreter (libgomp reads its environment once, at load), interleaved over `--rounds`:
- `spin`:    a plain torch process, one thread pool: libgomp's default (parked workers spin ~300,000 iterations).
- `guard`:   the same while trl_cb's guard thread is alive (`engine/openmp.py`: throttled, 1,000 spins then sleep).
- `passive`: `OMP_WAIT_POLICY=PASSIVE` (no spinning at all; needs the variable set before torch is imported).
- `one_thread`: `torch.set_num_threads(1)` (no OpenMP teams).

Each prints the median of `--iters` steps (batch 32 x 64 tokens); the table shows the median over rounds and every
round's value. The JSON document is the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CPU_PRESETS, background_load, cpu_preset, environment, format_table  # noqa: E402

CONDITIONS = {"spin": {}, "guard": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "one_thread": {}}


def worker(condition: str, model_name: str, iters: int) -> dict[str, Any]:
    import torch

    from trl_cb.engine import openmp

    if condition == "one_thread":
        torch.set_num_threads(1)
    model, tokenizer = cpu_preset(model_name, None)
    model.train()
    ids = torch.randint(3, len(tokenizer), (32, 64))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    step()
    release = openmp.hold_polite_waits() if condition == "guard" else (lambda: None)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    release()
    return {"condition": condition, "median_ms": 1000 * statistics.median(times), "min_ms": 1000 * min(times)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", choices=CPU_PRESETS)
    p.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=list(CONDITIONS))
    p.add_argument("--background-load", type=int, nargs="+", default=[0, 2], help="busy processes alongside")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--worker", nargs=3, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        condition, model_name, iters = args.worker
        print(json.dumps(worker(condition, model_name, int(iters))))
        return {}
    results: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for load in args.background_load:
            with background_load(load):
                for condition in args.conditions:
                    env = {**os.environ, **CONDITIONS[condition]}
                    cmd = [sys.executable, __file__, "--worker", condition, args.model, str(args.iters)]
                    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, check=True)
                    ms = json.loads(out.stdout.strip().splitlines()[-1])["median_ms"]
                    results.setdefault((load, condition), []).append(ms)
    points = [
        {"background_load": load, "condition": c, "median_ms": statistics.median(v), "rounds_ms": v}
        for (load, c), v in results.items()
    ]
    rows = [
        {
            "load": pt["background_load"], "condition": pt["condition"], "median": pt["median_ms"],
            "rounds": " ".join(f"{x:.0f}" for x in pt["rounds_ms"]),
        }
        for pt in points
    ]  # fmt: skip
    print(f"forward+backward, model={args.model}, batch 32 x 64, ms (median over rounds of per-round medians)")
    columns = [("load", "bg load"), ("condition", "condition"), ("median", "ms"), ("rounds", "rounds")]
    print(format_table(rows, columns))
    payload = {"benchmark": "threads_probe", "config": vars(args), "env": environment("cpu"), "points": points}
    print(json.dumps(payload))
    return payload


if __name__ == "__main__":
    main()
