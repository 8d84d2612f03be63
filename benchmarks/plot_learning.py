"""Render a learning-benchmark JSON (from benchmarks/learning.py) to a PNG, one row per trainer:
1. the evaluation reward of the current weights against training wall-clock (evaluation excluded),
2. the same against completions trained on,
3. the training-batch reward (what TRL logs) against the policy version that sampled each batch (step minus its mean
   staleness: an async curve is no longer shifted by its staleness),
4. what off-policy correction does per step: the IS ratio's batch mean, async staleness on a second axis.
Each curve (backend, or async backend and variant) is its mean over seeds with a min-max band; the threshold is a
dashed line, each curve's time to it a dotted one.

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

LABELS = {
    "generate": "generate() (TRL)",
    "trl_cb": "trl_cb",
    "trl_cb_async": "trl_cb async",
    "trl_cb_overlap_async": "trl_cb overlap",
    "trl_cb_server": "trl_cb server",
    "trl_cb_server_async": "trl_cb server async",
}


def _label(s: dict[str, Any]) -> str:
    name = LABELS.get(s["backend"], s["backend"])
    return name if not s.get("variant") else f"{name} [{s['variant']}]"


def render(json_path: Path, png_path: Path) -> Path:
    payload = json.loads(Path(json_path).read_text())
    summary, cfg, env = payload["summary"], payload["config"], payload["env"]
    trainers = [t for t in ("grpo", "rloo") if any(s["trainer"] == t for s in summary)]
    colors = {name: f"C{i % 10}" for i, name in enumerate(dict.fromkeys(s["curve"] for s in summary))}
    fig, axes = plt.subplots(len(trainers), 4, figsize=(22, 4.2 * len(trainers)), squeeze=False)
    for row, kind in zip(axes, trainers):
        ax_time, ax_samples, ax_version, ax_is = row
        entries = [s for s in summary if s["trainer"] == kind]
        for s in entries:
            color, ev = colors[s["curve"]], s["eval"]
            label = f"{_label(s)} (n={len(s['seeds'])})"
            for ax, x in ((ax_time, ev["wall_clock_s"]["mean"]), (ax_samples, ev["samples"])):
                ax.plot(x, ev["reward"]["mean"], color=color, marker=".", label=label)
                ax.fill_between(x, ev["reward"]["min"], ev["reward"]["max"], color=color, alpha=0.15, lw=0)
            crossed = s.get("time_to_threshold_s_interp", s["time_to_threshold_s"])  # interpolated since issue 31
            if crossed is not None:
                ax_time.axvline(crossed, color=color, lw=0.8, ls=":")
            x = s["batch_policy_version"]
            ax_version.plot(x, s["reward"]["mean"], color=color, label=label)
            ax_version.fill_between(x, s["reward"]["min"], s["reward"]["max"], color=color, alpha=0.15, lw=0)
        panels = (
            (ax_time, "training wall-clock, evaluation excluded (s)", "eval reward, current weights"),
            (ax_samples, "completions trained on", "eval reward, current weights"),
            (ax_version, "policy version that sampled the batch (step - mean staleness)", "training-batch reward"),
        )
        for ax, xlabel, ylabel in panels:
            ax.axhline(cfg["threshold"], color="grey", lw=0.8, ls="--")
            ax.set(xlabel=xlabel, ylabel=ylabel, title=f"{kind.upper()}: {ylabel} vs {xlabel.split(' (')[0]}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
        _off_policy_panel(ax_is, [r for r in payload.get("runs", []) if r["trainer"] == kind], kind, colors)
    reward_name = f"share of {cfg['char']!r}" if cfg["reward"] == "char" else "GSM8K accuracy"
    fig.suptitle(
        f"{cfg['model']} on {env['device']}, task {cfg.get('task', 'default')}: reward = {reward_name}, batch "
        f"{cfg['prompts_per_step']}x{cfg['num_generations']}, <= {cfg['max_completion_length']} tokens, lr "
        f"{cfg['learning_rate']}; eval every {cfg.get('eval_every')} steps on {cfg.get('eval_prompts')}x"
        f"{cfg.get('eval_samples')} held-out samples; mean and min-max over seeds {cfg['seeds']} "
        f"(transformers {env['transformers']}, trl {env['trl']})",
        fontsize=8,
    )
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def _seed_mean(rows: list[list[float | None]]) -> list[float]:
    return [statistics.fmean(x or 0.0 for x in c) for c in zip(*rows)]


def _off_policy_panel(ax: Any, runs: list[dict[str, Any]], kind: str, colors: dict[str, str]) -> None:
    """IS ratio (batch mean, seed mean) per step for the CB backends; async staleness on a second axis."""
    twin = None
    for curve in colors:
        mine = [r for r in runs if r["curve"] == curve]
        rows = [r["is_ratio_mean"] for r in mine if r.get("is_ratio_mean")]
        if rows:
            ax.plot(range(1, len(rows[0]) + 1), _seed_mean(rows), color=colors[curve], label=curve)
        stale = [r["async"]["staleness_mean"] for r in mine if (r.get("async") or {}).get("staleness_mean")]
        if stale:
            twin = twin or ax.twinx()
            twin.plot(range(1, len(stale[0]) + 1), _seed_mean(stale), color=colors[curve], ls=":", lw=1.2)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="optimizer step", ylabel="IS ratio, batch mean", title=f"{kind.upper()}: off-policy correction")
    ax.grid(alpha=0.3)
    if twin is not None:
        twin.set_ylabel("staleness of trained groups (dotted, steps)")
        twin.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="lower left")


def main() -> None:
    from common import redraw_main

    redraw_main(render, __doc__)


if __name__ == "__main__":
    main()
