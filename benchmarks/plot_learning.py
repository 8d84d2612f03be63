"""Render a learning-benchmark JSON (from benchmarks/learning.py) to a PNG: reward vs wall-clock and reward vs samples,
one row per trainer, the mean over seeds per backend with its min-max band and the threshold line; a third panel shows
what off-policy correction does per step (the IS ratio's batch mean for the trl_cb backends, async staleness).

    python benchmarks/plot_learning.py runs/benchmarks/learning-YYYYmmdd-HHMMSS.json [--out plot.png]

Needs no model and no GPU: plots can be redrawn anywhere from the JSON.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ORDER = ["generate", "trl_cb", "trl_cb_async", "trl_cb_server", "trl_cb_server_async"]
LABELS = {
    "generate": "generate() (TRL)",
    "trl_cb": "trl_cb",
    "trl_cb_async": "trl_cb async",
    "trl_cb_server": "trl_cb server",
    "trl_cb_server_async": "trl_cb server async",
}


def render(json_path: Path, png_path: Path) -> Path:
    payload = json.loads(Path(json_path).read_text())
    summary, cfg, env = payload["summary"], payload["config"], payload["env"]
    trainers = [t for t in ("grpo", "rloo") if any(s["trainer"] == t for s in summary)]
    fig, axes = plt.subplots(len(trainers), 3, figsize=(16, 3.8 * len(trainers)), squeeze=False)
    for row, kind in zip(axes, trainers):
        ax_time, ax_samples, ax_is = row
        entries = sorted((s for s in summary if s["trainer"] == kind), key=lambda s: ORDER.index(s["backend"]))
        for s in entries:
            reward = s["reward"]
            for ax, x in ((ax_time, s["wall_clock_s"]["mean"]), (ax_samples, s["samples"])):
                color = f"C{ORDER.index(s['backend'])}"
                (line,) = ax.plot(
                    x, reward["mean"], color=color, label=f"{LABELS[s['backend']]} (n={len(s['seeds'])})"
                )
                ax.fill_between(x, reward["min"], reward["max"], color=line.get_color(), alpha=0.18, lw=0)
            if s["time_to_threshold_s"] is not None:
                ax_time.axvline(s["time_to_threshold_s"], color=line.get_color(), lw=0.8, ls=":")
        for ax, xlabel in ((ax_time, "wall-clock since train() began (s)"), (ax_samples, "completions trained on")):
            ax.axhline(cfg["threshold"], color="grey", lw=0.8, ls="--")
            ax.set(xlabel=xlabel, ylabel="mean reward of the step's batch", title=f"{kind.upper()}: vs {xlabel}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="lower right")
        _off_policy_panel(ax_is, [r for r in payload.get("runs", []) if r["trainer"] == kind], kind)
    reward_name = f"share of {cfg['char']!r}" if cfg["reward"] == "char" else "GSM8K accuracy"
    fig.suptitle(
        f"{cfg['model']} on {env['device']}: reward = {reward_name}, batch {cfg['prompts_per_step']}x"
        f"{cfg['num_generations']}, <= {cfg['max_completion_length']} tokens, lr {cfg['learning_rate']}; "
        f"mean and min-max over seeds {cfg['seeds']} (transformers {env['transformers']}, trl {env['trl']})",
        fontsize=8,
    )
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


def _seed_mean(rows: list[list[float]]) -> list[float]:
    return [statistics.fmean(c) for c in zip(*rows)]


def _off_policy_panel(ax: Any, runs: list[dict[str, Any]], kind: str) -> None:
    """IS ratio (batch mean, seed mean) per step for the CB backends; async staleness on a second axis."""
    for backend in ORDER[1:]:
        rows = [r["is_ratio_mean"] for r in runs if r["backend"] == backend and r.get("is_ratio_mean")]
        if rows:
            ax.plot(
                range(1, len(rows[0]) + 1),
                _seed_mean(rows),
                color=f"C{ORDER.index(backend)}",
                label=f"{LABELS[backend]}",
            )
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="optimizer step", ylabel="IS ratio, batch mean", title=f"{kind.upper()}: off-policy correction")
    ax.grid(alpha=0.3)
    twin = None
    for backend in ("trl_cb_async", "trl_cb_server_async"):
        stale = [r["async"]["staleness_mean"] for r in runs if r.get("async") and r["backend"] == backend]
        if stale:
            twin = twin or ax.twinx()
            twin.plot(range(1, len(stale[0]) + 1), _seed_mean(stale), color=f"C{ORDER.index(backend)}", ls=":",
                      lw=1.2, label=f"{LABELS[backend]} staleness (right axis)")  # fmt: skip
    if twin is not None:
        twin.set_ylabel("staleness of trained groups (steps)")
        twin.set_ylim(bottom=0)
        twin.legend(fontsize=8, loc="upper right")
    ax.legend(fontsize=8, loc="lower left")


def main() -> None:
    from common import redraw_main

    redraw_main(render, __doc__)


if __name__ == "__main__":
    main()
