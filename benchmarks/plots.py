"""PNG renderings of the benchmarks' JSON documents (`--replot FILE` on each script redraws one: no model, no GPU).

Each `render_*(json_path, png_path)` reads a document written by `common.ResultFile` (complete or not: a run redraws
after every point) and returns the PNG path.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _load(json_path: Path) -> dict[str, Any]:
    return json.loads(Path(json_path).read_text())


def _save(fig: Any, png_path: Path, title: str, dpi: int = 120) -> Path:
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=dpi)
    plt.close(fig)
    return png_path


def _panels(count: int) -> tuple[Any, list[Any]]:
    """A figure with `count` panels side by side (at least one)."""
    fig, axes = plt.subplots(1, max(1, count), figsize=(5 * max(1, count), 4), squeeze=False)
    return fig, list(axes[0])


def _versions(env: dict[str, Any]) -> str:
    return f"{env['device']}, transformers {env['transformers']}, trl {env['trl']}, commit {env.get('git_commit')}"


def render_gsm8k(json_path: Path, png_path: Path) -> Path:
    """Time per round and speed against `generate()` over N, one line per backend (the first workload's sweep)."""
    payload = _load(json_path)
    summary = payload.get("summary", [])
    sweep = summary[0]["workload"] if summary else None
    points = [s for s in summary if s["workload"] == sweep]
    fig, (ax_time, ax_speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    for backend in dict.fromkeys(s["backend"] for s in points):
        pts = sorted((s for s in points if s["backend"] == backend), key=lambda s: s["num_generations"])
        ns = [s["num_generations"] for s in pts]
        ax_time.errorbar(
            ns, [s["round_time_s"]["mean"] for s in pts], yerr=[s["round_time_s"]["std"] for s in pts],
            marker="o", capsize=3, label=backend,
        )  # fmt: skip
        speed = [(s["num_generations"], s["speedup_vs_generate"]) for s in pts if s["speedup_vs_generate"]]
        if speed:
            ax_speed.plot(*zip(*speed), marker="o", label=backend)
    ax_time.set(xlabel="generations per prompt (N)", ylabel="seconds per round", title="Time per generation round")
    ax_speed.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax_speed.set(xlabel="generations per prompt (N)", ylabel="speed vs generate()", title="Speed vs generate()")
    for ax in (ax_time, ax_speed):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    cfg = payload["config"]
    shape = f"{cfg['prompts_per_round']} prompts/round, max {cfg['max_new_tokens']} new tokens, workload {sweep}"
    return _save(fig, png_path, f"{cfg['model']}: {shape} ({_versions(payload['env'])})")


def render_engine_step(json_path: Path, png_path: Path) -> Path:
    """ms per decode step over rows, one line per backend, one panel per model."""
    payload = _load(json_path)
    summary = payload.get("summary", [])
    models = list(dict.fromkeys(s["model"] for s in summary))
    fig, axes = _panels(len(models))
    for ax, model in zip(axes, models):
        mine = [s for s in summary if s["model"] == model]
        for backend in dict.fromkeys(s["backend"] for s in mine):
            pts = sorted((s for s in mine if s["backend"] == backend), key=lambda s: s["rows"])
            ax.plot([s["rows"] for s in pts], [s["ms_per_step"] for s in pts], marker="o", label=backend)
        ax.set(xlabel="rows", ylabel="ms per decode step", title=model)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, png_path, f"engine step sweep ({_versions(payload['env'])})")


def render_grpo_step(json_path: Path, png_path: Path) -> Path:
    """Median step time per backend (bars with min-max), one group per trainer."""
    payload = _load(json_path)
    summary = payload.get("summary", [])
    labels = [f"{s['trainer']} {s['backend']}" + (f" load {s['background_load']}" if s["background_load"] else "")
              for s in summary]  # fmt: skip
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(summary) + 2), 4.2))
    medians = [s["step_time_s"]["median"] for s in summary]
    errors = [[m - s["step_time_s"]["min"] for m, s in zip(medians, summary)],
              [s["step_time_s"]["max"] - m for m, s in zip(medians, summary)]]  # fmt: skip
    ax.bar(range(len(summary)), medians, yerr=errors, capsize=3, color=[f"C{i % 10}" for i in range(len(summary))])
    ax.set_xticks(range(len(summary)), labels, rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="seconds per training step (median, min-max)")
    ax.grid(alpha=0.3, axis="y")
    cfg, env = payload["config"], payload["env"]
    shape = f"{cfg['prompts']} prompts x {cfg['num_generations']}, <= {cfg['max_completion_length']} tokens"
    return _save(fig, png_path, f"{cfg['model']}: {shape} ({_versions(env)})")


def render_server(json_path: Path, png_path: Path) -> Path:
    """One bar chart per part: each row's headline figure."""
    payload = _load(json_path)
    parts = list(dict.fromkeys(p["key"][0] for p in payload.get("points", [])))
    fig, axes = _panels(len(parts))
    for ax, part in zip(axes, parts):
        rows = [p for p in payload["points"] if p["key"][0] == part]
        ax.bar(range(len(rows)), [p["headline"] for p in rows], color=[f"C{i % 10}" for i in range(len(rows))])
        ax.set_xticks(range(len(rows)), [" ".join(map(str, p["key"][1:])) for p in rows], rotation=30, ha="right")
        ax.set(title=part, ylabel=rows[0]["headline_unit"])
        ax.grid(alpha=0.3, axis="y")
    return _save(fig, png_path, f"rollout server ({_versions(payload['env'])})")


def render_agent(json_path: Path, png_path: Path) -> Path:
    """The agent task: the evaluated reward per step, one line per run (backend, seed); mean step time per backend.
    The runs are the document's points keyed `("steps", backend, seed)` (documents of every version hold them)."""
    payload = _load(json_path)
    fig, (ax_reward, ax_step) = plt.subplots(1, 2, figsize=(11, 4.2))
    runs = [p for p in payload.get("points", []) if p["key"][0] == "steps"]
    backends = list(dict.fromkeys(r["backend"] for r in runs))
    for i, backend in enumerate(backends):
        for run in (r for r in runs if r["backend"] == backend):
            ax_reward.plot(run["evaluated_reward"], color=f"C{i}", alpha=0.7, label=f"{backend} seed {run['seed']}")
    summary = payload.get("summary", [])
    ax_step.bar(range(len(summary)), [s["step_time_s"] for s in summary], color=[f"C{i}" for i in range(len(summary))])
    ax_step.set_xticks(range(len(summary)), [s["backend"] for s in summary])
    ax_reward.set(xlabel="optimizer step", ylabel="evaluated reward (probability of a rewarded trajectory)")
    ax_step.set(ylabel="mean step time (s)")
    for ax in (ax_reward, ax_step):
        ax.grid(alpha=0.3)
    ax_reward.legend(fontsize=7)
    return _save(fig, png_path, f"agent task ({_versions(payload['env'])})")


# ---------------------------------------------------------------------------------------------------- learning

LEARNING_LABELS = {
    "generate": "generate() (TRL)",
    "trl_cb": "trl_cb",
    "trl_cb_async": "trl_cb async",
    "trl_cb_overlap_async": "trl_cb overlap",
    "trl_cb_server": "trl_cb server",
    "trl_cb_server_async": "trl_cb server async",
}


def _learning_label(s: dict[str, Any]) -> str:
    name = LEARNING_LABELS.get(s["backend"], s["backend"])
    return name if not s.get("variant") else f"{name} [{s['variant']}]"


def render_learning(json_path: Path, png_path: Path) -> Path:
    """One row per trainer: (1) evaluation reward of the current weights against training wall-clock (evaluation
    excluded), (2) the same against completions trained on, (3) the training-batch reward against the policy version
    that sampled each batch, (4) the IS ratio's batch mean per step with async staleness on a second axis. Each curve
    is its mean over seeds with a min-max band; the threshold is dashed, each curve's time to it dotted."""
    payload = _load(json_path)
    summary, cfg, env = payload.get("summary", []), payload["config"], payload["env"]
    trainers = [t for t in ("grpo", "rloo") if any(s["trainer"] == t for s in summary)] or ["grpo"]
    colors = {name: f"C{i % 10}" for i, name in enumerate(dict.fromkeys(s["curve"] for s in summary))}
    fig, axes = plt.subplots(len(trainers), 4, figsize=(22, 4.2 * len(trainers)), squeeze=False)
    for row, kind in zip(axes, trainers):
        ax_time, ax_samples, ax_version, ax_is = row
        for s in (s for s in summary if s["trainer"] == kind):
            color, ev = colors[s["curve"]], s["eval"]
            label = f"{_learning_label(s)} (n={len(s['seeds'])})"
            for ax, x in ((ax_time, ev["wall_clock_s"]["mean"]), (ax_samples, ev["samples"])):
                ax.plot(x, ev["reward"]["mean"], color=color, marker=".", label=label)
                ax.fill_between(x, ev["reward"]["min"], ev["reward"]["max"], color=color, alpha=0.15, lw=0)
            crossed = s.get("time_to_threshold_s_interp", s["time_to_threshold_s"])
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
        runs = payload.get("runs", payload.get("points", []))  # recorded before and after runs became points
        _off_policy_panel(ax_is, [r for r in runs if r["trainer"] == kind], kind, colors)
    reward_name = f"share of {cfg['char']!r}" if cfg["reward"] == "char" else "GSM8K accuracy"
    title = (
        f"{cfg['model']}, task {cfg.get('task', 'default')}: reward = {reward_name}, batch "
        f"{cfg['prompts_per_step']}x{cfg['num_generations']}, <= {cfg['max_completion_length']} tokens, lr "
        f"{cfg['learning_rate']}; eval every {cfg.get('eval_every')} steps on {cfg.get('eval_prompts')}x"
        f"{cfg.get('eval_samples')} held-out samples; mean and min-max over seeds {cfg['seeds']} ({_versions(env)})"
    )
    return _save(fig, png_path, title, dpi=110)


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
