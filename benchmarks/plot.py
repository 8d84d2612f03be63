"""Render a benchmark JSON (from benchmarks/gsm8k.py) to a PNG: time per round and speedup vs N, one line per backend.

    python benchmarks/plot.py runs/benchmarks/gsm8k-YYYYmmdd-HHMMSS.json [--out plot.png]

Needs no model and no GPU: plots can be redrawn anywhere from the JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def render(json_path: Path, png_path: Path) -> Path:
    payload = json.loads(Path(json_path).read_text())
    # The sweep over N (the first points' workload); gsm8k.py's extra no-tail points are in its table and JSON.
    sweep = payload["points"][0].get("workload") if payload["points"] else None
    points = [p for p in payload["points"] if p.get("workload") == sweep]
    backends = sorted({p["backend"] for p in points}, key=["generate", "trl_native", "trl_cb"].index)
    fig, (ax_time, ax_speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    for backend in backends:
        pts = sorted((p for p in points if p["backend"] == backend), key=lambda p: p["num_generations"])
        ns = [p["num_generations"] for p in pts]
        means = [p["round_time_s"]["mean"] for p in pts]
        stds = [p["round_time_s"]["std"] for p in pts]
        ax_time.errorbar(ns, means, yerr=stds, marker="o", capsize=3, label=backend)
        if all(p["speedup_vs_generate"] is not None for p in pts):
            ax_speed.plot(ns, [p["speedup_vs_generate"] for p in pts], marker="o", label=backend)
    ax_time.set(xlabel="generations per prompt (N)", ylabel="seconds per round", title="Time per generation round")
    ax_speed.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax_speed.set(xlabel="generations per prompt (N)", ylabel="speedup vs generate()", title="Speedup vs generate()")
    for ax in (ax_time, ax_speed):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    env, cfg = payload["env"], payload["config"]
    fig.suptitle(
        f"{cfg['model']} on {env['device']} — {cfg['prompts_per_round']} prompts/round, "
        f"max {cfg['max_new_tokens']} new tokens (transformers {env['transformers']}, trl {env['trl']})",
        fontsize=9,
    )
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


def main() -> None:
    from common import redraw_main

    redraw_main(render, __doc__)


if __name__ == "__main__":
    main()
