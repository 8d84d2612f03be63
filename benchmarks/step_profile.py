"""Per-step-kind profile of a trl_cb engine: where each kind of step spends the engine thread's CPU time.

Why: a round's average ms per decode step mixes three kinds of steps with very different costs (docs/benchmarks.md,
"Engine step sweep (issue 28)"): `fast` decode steps (the persistent batch, `engine/_upstream_decode.py`), `decode`
steps on upstream's per-request path (the first decode step after the forks, any step the fast path hands back) and
`prefill` steps (a batch with a multi-token query). Which kind a step was is read from the fast path's counters and
the batch's query lengths; its phases are timed with `time.thread_time` (the engine thread's CPU time: time other
processes or threads take is not counted) around the engine's own methods:
- `schedule`: the scheduler's `schedule_batch`; `prepare`: the rest of `prepare_next_batch` (batch tensors);
- `forward_sample`: `ModelRunner.compute_batch` (forward, logits processing, sampling), of which `sampling`
  (`ModelRunner._sample`), `attention` (trl_cb's varlen attention, all layers) and `plan` (its batch plan);
- `update`: `update_batch` (tokens appended, finished requests delivered, forks); `step`: the whole step.
Benchmark-only: it reaches the engine through private attributes. Its timers add a few µs per call (per layer for
the attention), so a profiled run's ms per step is not the figure to compare: `engine_step.py` records both.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

KINDS = ("fast", "decode", "prefill")
PHASES = ("schedule", "prepare", "forward_sample", "sampling", "attention", "plan", "update", "step")


class StepProfiler:
    """Collects one phase dict (CPU ms) per engine step, keyed by the step's kind; `summary(rounds)` reduces them."""

    def __init__(self, generator: Any) -> None:
        from trl_cb.engine import _upstream_decode, varlen_attention

        manager = generator._pool.engine.manager
        processor = manager.batch_processor
        self._stats = _upstream_decode.decode_fast_path_stats(manager)  # None where the fast path is off
        self._ios = processor.inputs_and_outputs
        self._current: dict[str, float] = defaultdict(float)
        self._kind: str | None = None
        self._last_fast = self._stats.fast if self._stats is not None else 0
        self.steps: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
        self._wrap(processor.scheduler, "schedule_batch", "schedule")
        self._wrap(processor, "prepare_next_batch", "prepare", after=self._classify)
        self._wrap(processor.model_runner, "compute_batch", "forward_sample")
        self._wrap(processor.model_runner, "_sample", "sampling")
        self._wrap(varlen_attention, "packed_varlen_attention", "attention")
        self._wrap(varlen_attention, "_plan", "plan")
        self._wrap(processor, "update_batch", "update", after=self._close)

    def _wrap(self, obj: Any, attr: str, phase: str, after: Callable[[Any], None] | None = None) -> None:
        original, current = getattr(obj, attr), self._current

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            result = original(*args, **kwargs)
            current[phase] += 1000 * (time.thread_time() - start)
            if after is not None:
                after(result)
            return result

        setattr(obj, attr, timed)

    def _classify(self, has_batch: bool) -> None:
        """After `prepare_next_batch`: which kind of step this is (or no step: nothing to run)."""
        if not has_batch:
            self._current.clear()
            return
        fast = self._stats.fast if self._stats is not None else 0
        if fast != self._last_fast:
            self._kind = "fast"
        elif any(f.query_length > 1 for f in self._ios.requests_in_batch):
            self._kind = "prefill"
        else:
            self._kind = "decode"
        self._last_fast = fast
        self._current["step_start"] = time.thread_time()

    def _close(self, _: Any) -> None:
        """After `update_batch`: the step is complete; `prepare` excludes `schedule`, `step` is the whole step."""
        current = self._current
        step = 1000 * (time.thread_time() - current.pop("step_start")) + current["prepare"]
        phases = {p: current.get(p, 0.0) for p in PHASES}
        phases["prepare"] -= phases["schedule"]
        phases["step"] = step
        if self._kind is not None:
            self.steps[self._kind].append(phases)
        current.clear()
        self._kind = None

    def summary(self, rounds: int) -> dict[str, dict[str, Any]]:
        """Per kind: steps per round, the median CPU ms of each phase per step, and the kind's total CPU ms per round
        (what it adds to a round: divided by the round's tokens, its share of the ms per decode step)."""
        out = {}
        for kind, steps in self.steps.items():
            out[kind] = {
                "steps_per_round": len(steps) / rounds,
                "median_ms": {p: statistics.median(s[p] for s in steps) if steps else 0.0 for p in PHASES},
                "ms_per_round": {p: sum(s[p] for s in steps) / rounds for p in PHASES},
            }
        return out


def merge(summaries: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Passes merged: the median over passes of every number."""
    return {
        kind: {
            "steps_per_round": statistics.median(s[kind]["steps_per_round"] for s in summaries),
            **{
                field: {p: statistics.median(s[kind][field][p] for s in summaries) for p in PHASES}
                for field in ("median_ms", "ms_per_round")
            },
        }
        for kind in KINDS
    }


def format_profile(points: list[dict[str, Any]]) -> str:
    """One line per (point, kind): steps per round, then median CPU ms per phase."""
    lines = ["step kinds (CPU ms, median per step; per round: steps, ms): " + " / ".join(PHASES)]
    for p in points:
        for kind, s in p.get("step_profile", {}).items():
            if s["steps_per_round"]:
                cells = " / ".join(f"{s['median_ms'][ph]:.3f}" for ph in PHASES)
                lines.append(
                    f"  {p['model']} {p['rows']} {p['backend']} {kind}: {s['steps_per_round']:.1f} steps, "
                    f"{s['ms_per_round']['step']:.2f} ms/round | {cells}"
                )
    return "\n".join(lines)
