"""Per-step cost of the engine against `generate()` as rows grow: ms per decode step, µs per added row, and where a
step's time goes.

    python benchmarks/engine_step.py                          # null, tiny x 32/128/512 rows (CPU default)
    python benchmarks/engine_step.py --models small --rows 32 128 512 1024   # compute-heavier, longer
    python benchmarks/engine_step.py --quick                  # ~20 s, for smoke tests (not for numbers)
    python benchmarks/engine_step.py --models llama-1b-random --device cuda --rows 32 256 --max-new-tokens 64 \\
        --variant 'no_graphs:{"use_cuda_graph": false}'      # + trl_cb without CUDA graphs, in the same run
    python benchmarks/engine_step.py --models null tiny --rows 32 128 512 --profile-steps   # + CPU per step kind

Workload: `rows / --samples-per-prompt` random prompts of `--prompt-len` tokens, each sampled `--samples-per-prompt`
times (TRL repeats each prompt G times), no length tail: EOS is never sampled (`common.suppress_eos`) so every
completion runs to `--max-new-tokens` (checked: a point fails otherwise). Temperature 1, top_k 0, top_p 1 (no logits
processor on either side), float32 on CPU, bfloat16 on CUDA.

Models: `null` (1 layer x 32 wide: a step is framework cost), `tiny`, `small`, `llama-1b-random`, and the hybrids
`tiny-qwen3.5` / `qwen3.5-0.8b-random` (Qwen3.5's Gated DeltaNet layout, state per sequence) (`common.PRESETS`).

Backends, each in its own process kept across its points (`common.Workers`), the backends interleaved point by point
so that load drift hits them alike:
- `generate`: one padded `model.generate` call over all rows, as TRL's default path.
- `trl_cb`: `ContinuousBatchingGenerator` (persistent engine, prefill shared per prompt, logprobs).
- `trl_cb:NAME`: the same with the engine settings of `--variant NAME:JSON` (`transformers_continuous_batching_config`
  keys), measured in the same run.

Measured per timed round (after one warm-up round that also builds the engine): wall time / max_new_tokens = ms per
decode step (the short prefill included, the same for every backend), the process's CPU time per step likewise (the
steadier measure on a loaded machine), and wall-clock timers around the engine's phases, per step:
- trl_cb: `scheduling` (`prepare_next_batch`), `sampling` (`ModelRunner._sample`), `attention` (trl_cb's attention
  kernels; `attention_planning`: building the per-batch plan), `forward` (the rest of the forward), `bookkeeping`
  (`update_batch` and the step's host transfers), `other` (submission, collection, thread hand-offs).
- generate: `forward` (outside attention), `attention` (sdpa), `sampling` (`torch.multinomial`), `other`.
On a GPU the phase timers measure host time (kernels run asynchronously; a round's wall time is synchronized).
`--passes N` runs the whole interleaved sweep N times (rounds pooled, the median profile over passes).
`--profile-steps` adds the engine thread's CPU time per step kind (fast / upstream decode / prefill) and phase, in
`--repeats` more rounds after the timed ones (its timers never reach a timed round).
Per-row cost (µs per row per step) is the slope of ms/step between consecutive row counts. Every point is written to
the JSON as soon as it is measured (`--resume FILE` completes an interrupted run).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import plots  # noqa: E402

#: The CPU default: framework cost (`null`) and a small forward (`tiny`); `small` and 1,024 rows on request (on 2
#: loaded cores `generate()` alone took minutes per point there, its OpenMP workers spinning).
CPU_MODELS = ("null", "tiny")
TRL_CB_PHASES = ("scheduling", "sampling", "attention", "attention_planning", "forward", "bookkeeping", "other")
#: trl_cb's attention entry points and plan builders, as (module, attribute, phase); missing ones are skipped (the
#: engine's kernels differ by device and version).
ATTENTION_HOOKS = (
    ("trl_cb.engine.varlen_attention", "packed_varlen_attention", "attention"),
    ("trl_cb.engine.paged_decode", "attend", "attention"),
    ("trl_cb.engine.varlen_attention", "_plan_for", "attention_planning"),
)
STEP_KINDS = ("fast", "decode", "prefill")
STEP_PHASES = ("schedule", "prepare", "forward_sample", "sampling", "attention", "plan", "update", "step")


# ------------------------------------------------------------------------------------------------------ timers


class Patches:
    """Attribute replacements undone together (a worker process measures many points)."""

    def __init__(self) -> None:
        self.undo: list[tuple[Any, str, Any]] = []

    def wrap(self, obj: Any, attr: str, make: Callable[[Any], Any]) -> bool:
        original = getattr(obj, attr, None)
        if original is None:
            return False
        self.undo.append((obj, attr, obj.__dict__.get(attr) if hasattr(obj, "__dict__") else original))
        setattr(obj, attr, make(original))
        return True

    def restore(self) -> None:
        for obj, attr, original in reversed(self.undo):
            if original is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, original)
        self.undo.clear()


class PhaseTimer:
    """Wall-clock seconds per named phase; phases nest (attention inside the forward), each keeps its own total."""

    def __init__(self, patches: Patches) -> None:
        self.patches = patches
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, obj: Any, attr: str, phase: str) -> bool:
        totals, calls = self.totals, self.calls

        def make(original: Any) -> Any:
            def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    totals[phase] += time.perf_counter() - start
                    calls[phase] += 1

            return timed

        return self.patches.wrap(obj, attr, make)

    def reset(self) -> None:
        self.totals.clear()
        self.calls.clear()


def _instrument_trl_cb(generator: Any, timer: PhaseTimer) -> None:
    """Time the engine's phases. Benchmark-only: reaches the generator's engine through private attributes."""
    processor = generator._pool.engine.manager.batch_processor
    timer.wrap(processor, "prepare_next_batch", "scheduling")
    timer.wrap(processor, "update_batch", "update")
    timer.wrap(processor, "_generation_step", "step")
    timer.wrap(processor.model_runner, "compute_batch", "compute")
    timer.wrap(processor.model_runner, "_sample", "sampling")
    for module, attr, phase in ATTENTION_HOOKS:
        try:
            timer.wrap(importlib.import_module(module), attr, phase)
        except ImportError:
            pass


def _instrument_generate(model: Any, timer: PhaseTimer) -> None:
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    timer.wrap(model, "forward", "forward")
    timer.wrap(torch, "multinomial", "sampling")
    holder = type("Holder", (), {"sdpa": staticmethod(sdpa_attention_forward)})
    timer.wrap(holder, "sdpa", "attention")
    AttentionInterface.register("sdpa", holder.sdpa)  # undone by `_restore_sdpa`


def _restore_sdpa() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("sdpa", sdpa_attention_forward)


def _profile(totals: dict[str, float], steps: int, wall: float, engine: bool) -> dict[str, float]:
    """ms per step per phase from the timers' totals: the engine's phases (`TRL_CB_PHASES`), or `generate()`'s."""
    ms = defaultdict(float, {k: 1000 * v / steps for k, v in totals.items()})
    total = 1000 * wall / steps
    if not engine:  # `forward` wraps the whole forward, attention included
        phases = {"sampling": ms["sampling"], "attention": ms["attention"]}
        return {**phases, "forward": ms["forward"] - ms["attention"], "other": total - ms["forward"] - ms["sampling"]}
    return {
        "scheduling": ms["scheduling"], "sampling": ms["sampling"], "attention": ms["attention"],
        "attention_planning": ms["attention_planning"], "forward": ms["compute"] - ms["sampling"] - ms["attention"],
        "bookkeeping": ms["update"] + ms["step"] - ms["compute"],
        "other": total - ms["scheduling"] - ms["step"] - ms["update"],
    }  # fmt: skip


class StepProfiler:
    """The engine thread's CPU ms per step, by step kind: `fast` decode steps (the persistent batch), `decode` steps on
    upstream's per-request path, `prefill` steps (a batch with a multi-token query); timed with `time.thread_time`
    (other threads and processes not counted). Its timers add a few µs per call, so it profiles rounds of its own,
    after the timed ones (`run_point`): no timed round of any backend carries it."""

    def __init__(self, generator: Any, patches: Patches) -> None:
        from trl_cb.engine import _upstream_decode

        manager = generator._pool.engine.manager
        processor = manager.batch_processor
        self._stats = _upstream_decode.decode_fast_path_stats(manager)  # None where the fast path is off
        self._ios = processor.inputs_and_outputs
        self._current: dict[str, float] = defaultdict(float)
        self._kind: str | None = None
        self._last_fast = self._stats.fast if self._stats is not None else 0
        self.steps: dict[str, list[dict[str, float]]] = {kind: [] for kind in STEP_KINDS}
        self.patches = patches
        self._wrap(processor.scheduler, "schedule_batch", "schedule")
        self._wrap(processor, "prepare_next_batch", "prepare", after=self._classify)
        self._wrap(processor.model_runner, "compute_batch", "forward_sample")
        self._wrap(processor.model_runner, "_sample", "sampling")
        for module, attr, phase in ATTENTION_HOOKS:
            self._wrap(importlib.import_module(module), attr, "plan" if phase == "attention_planning" else phase)
        self._wrap(processor, "update_batch", "update", after=self._close)

    def _wrap(self, obj: Any, attr: str, phase: str, after: Callable[[Any], None] | None = None) -> None:
        current = self._current

        def make(original: Any) -> Any:
            def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.thread_time()
                result = original(*args, **kwargs)
                current[phase] += 1000 * (time.thread_time() - start)
                if after is not None:
                    after(result)
                return result

            return timed

        self.patches.wrap(obj, attr, make)

    def _classify(self, has_batch: bool) -> None:
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
        current = self._current
        step = 1000 * (time.thread_time() - current.pop("step_start", time.thread_time())) + current["prepare"]
        phases = {p: current.get(p, 0.0) for p in STEP_PHASES}
        phases["prepare"] -= phases["schedule"]
        phases["step"] = step
        if self._kind is not None:
            self.steps[self._kind].append(phases)
        current.clear()
        self._kind = None

    def summary(self, rounds: int) -> dict[str, dict[str, Any]]:
        """Per kind: steps per round, the median CPU ms of each phase per step, and the kind's CPU ms per round."""
        return {
            kind: {
                "steps_per_round": len(steps) / rounds,
                "median_ms": {p: statistics.median(s[p] for s in steps) if steps else 0.0 for p in STEP_PHASES},
                "ms_per_round": {p: sum(s[p] for s in steps) / rounds for p in STEP_PHASES},
            }
            for kind, steps in self.steps.items()
        }


# ------------------------------------------------------------------------------------------------------ worker

_MODELS: dict[tuple[Any, ...], tuple[Any, Any]] = {}


def _model(spec: dict[str, Any]) -> tuple[Any, Any]:
    """A model that never samples EOS (built once per worker process)."""
    import torch

    key = (spec["model"], spec["device"], spec["dtype"], spec["logit_scale"])
    if key not in _MODELS:
        _MODELS.clear()
        model, tokenizer = common.load_model(spec["model"], spec["device"], spec["dtype"])
        with torch.no_grad():
            common.suppress_eos(model, tokenizer.eos_token_id, spec["logit_scale"])
        _MODELS[key] = (model, tokenizer)
    return _MODELS[key]


def run_point(spec: dict[str, Any]) -> dict[str, Any]:
    """One (model, rows, backend) point: a warm-up round, then `repeats` timed rounds (then, with `profile_steps`,
    `repeats` rounds under the trl_cb step profiler, untimed)."""
    import torch
    from transformers import GenerationConfig

    from trl_cb import ContinuousBatchingGenerator

    torch.set_num_threads(spec["threads"])
    device, backend = spec["device"], spec["backend"]
    model, tokenizer = _model(spec)
    rows, group, new = spec["rows"], spec["samples_per_prompt"], spec["max_new_tokens"]
    gen_cfg = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    patches = Patches()
    timer = PhaseTimer(patches)
    generator = None
    if backend.startswith("trl_cb"):
        generator = ContinuousBatchingGenerator(model, gen_cfg, continuous_batching_config=spec["cb_config"])
    else:
        _instrument_generate(model, timer)
    steps = None
    rng = torch.Generator().manual_seed(spec["seed"])
    step_ms, cpu_step_ms, profiles, forwards = [], [], [], []

    def one_round(r: int) -> tuple[float, float]:
        """Round `r` (its own prompts and seed; the phase timers reset): (wall s, process CPU s). Every completion
        must run to `new` tokens."""
        prompts = torch.randint(3, len(tokenizer), (rows // group, spec["prompt_len"]), generator=rng).tolist()
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
        if device != "cpu":
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if len(lengths) != rows or any(n != new for n in lengths):
            raise RuntimeError(f"{backend}: not every completion ran to {new} tokens (EOS sampled)")
        return wall, cpu

    try:
        one_round(0)  # warm-up (builds the engine)
        if generator is not None:
            _instrument_trl_cb(generator, timer)
        for r in range(1, 1 + spec["repeats"]):
            wall, cpu = one_round(r)
            step_ms.append(1000 * wall / new)
            cpu_step_ms.append(1000 * cpu / new)
            profiles.append(_profile(dict(timer.totals), new, wall, engine=generator is not None))
            forwards.append(timer.calls.get("compute" if generator else "forward", 0) / new)
        if generator is not None and spec["profile_steps"]:
            # `repeats` more rounds, after the timed ones: the step profiler's timers would add to trl_cb's ms per
            # step what `generate()` rounds never carry
            steps = StepProfiler(generator, patches)
            for r in range(1 + spec["repeats"], 1 + 2 * spec["repeats"]):
                one_round(r)
    finally:
        patches.restore()
        if generator is None:
            _restore_sdpa()
        else:
            generator.close()
    return {
        **({"step_profile": steps.summary(spec["repeats"])} if steps is not None else {}),
        "step_ms": step_ms, "cpu_step_ms": cpu_step_ms,
        "profile_ms": {k: statistics.median(p[k] for p in profiles) for k in profiles[0]},
        "forwards_per_step": statistics.median(forwards), "threads": torch.get_num_threads(),
    }  # fmt: skip


# -------------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=None, choices=common.PRESETS, help="default: the CPU models")
    p.add_argument("--rows", type=int, nargs="+", default=[32, 128, 512], help="rows (sequences) per round")
    p.add_argument("--samples-per-prompt", type=int, default=8, help="G: each prompt is sampled this many times")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per point (after one warm-up round)")
    p.add_argument("--passes", type=int, default=1, help="run the whole interleaved sweep this many times")
    p.add_argument("--backends", nargs="+", default=["generate", "trl_cb"], choices=["generate", "trl_cb"])
    p.add_argument(
        "--variant", action="append", default=[], metavar="NAME:JSON",
        help="an extra backend `trl_cb:NAME` with these engine settings, e.g. 'no_graphs:{\"use_cuda_graph\": false}'",
    )  # fmt: skip
    p.add_argument("--logit-scale", type=float, default=10.0, help="logit spread; EOS logit 0 (no length tail)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: torch's)")
    p.add_argument("--profile-steps", action="store_true", help="record trl_cb's CPU time per step kind and phase")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one point may take")
    args = common.parse(p, argv, "engine_step")
    if args.worker or args.replot:
        return args
    if args.models is None:
        args.models = list(CPU_MODELS) if args.device == "cpu" else ["llama-1b-random"]
    if args.quick:
        args.models, args.rows, args.max_new_tokens, args.repeats = ["null"], [8, 16], 4, 1
        args.samples_per_prompt = 4
    for name in ("samples_per_prompt", "prompt_len", "max_new_tokens", "repeats", "passes"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    bad = [r for r in args.rows if r <= 0 or r % args.samples_per_prompt]
    if bad:
        p.error(f"--rows must be positive multiples of --samples-per-prompt ({args.samples_per_prompt}), got {bad}")
    args.variants = {}
    for text in args.variant:
        name, _, settings = text.partition(":")
        try:
            value = json.loads(settings)
        except json.JSONDecodeError:
            value = None
        if not name or not isinstance(value, dict):
            p.error(f"--variant must look like NAME:JSON-object, got {text!r}")
        args.variants[name] = value
    if args.threads is None:
        import torch

        args.threads = torch.get_num_threads()
    return args


def _per_row_us(points: list[dict[str, Any]], key: str) -> dict[str, float]:
    """µs per added row per step (of `key`) between consecutive row counts of one (model, backend)."""
    ordered = sorted(points, key=lambda p: p["rows"])
    return {
        f"{a['rows']}->{b['rows']}": 1000 * (b[key] - a[key]) / (b["rows"] - a["rows"])
        for a, b in zip(ordered, ordered[1:])
    }


def summarize(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Passes merged per (model, rows, backend): every timed round's ms/step, the median profile over passes; speed
    against the first backend at the same (model, rows); per-row slopes."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for p in points:
        model, rows, backend, _ = p["key"]
        m = merged.setdefault((model, rows, backend), {"step_ms": [], "cpu_step_ms": [], "profiles": [], "kinds": []})
        m["step_ms"] += p["step_ms"]
        m["cpu_step_ms"] += p["cpu_step_ms"]
        m["profiles"].append(p["profile_ms"])
        m["forwards_per_step"] = p["forwards_per_step"]
        if "step_profile" in p:
            m["kinds"].append(p["step_profile"])
    summary = []
    for (model, rows, backend), m in merged.items():
        first = next(v for (mo, r, _), v in merged.items() if (mo, r) == (model, rows))
        ms, cpu_ms = statistics.median(m["step_ms"]), statistics.median(m["cpu_step_ms"])
        entry = {
            "model": model, "rows": rows, "backend": backend, "ms_per_step": ms, "cpu_ms_per_step": cpu_ms,
            "ms_per_step_rounds": m["step_ms"], "speed_vs_first_backend": statistics.median(first["step_ms"]) / ms,
            "cpu_speed_vs_first_backend": statistics.median(first["cpu_step_ms"]) / cpu_ms,
            "spread_vs_median": [min(m["step_ms"]) / ms, max(m["step_ms"]) / ms],
            "profile_ms": {k: statistics.median(p[k] for p in m["profiles"]) for k in m["profiles"][0]},
            "forwards_per_step": m["forwards_per_step"],
        }  # fmt: skip
        if m["kinds"]:
            entry["step_profile"] = {
                kind: {
                    "steps_per_round": statistics.median(s[kind]["steps_per_round"] for s in m["kinds"]),
                    **{
                        f: {ph: statistics.median(s[kind][f][ph] for s in m["kinds"]) for ph in STEP_PHASES}
                        for f in ("median_ms", "ms_per_round")
                    },
                }  # fmt: skip
                for kind in STEP_KINDS
            }
        summary.append(entry)
    pairs = dict.fromkeys((s["model"], s["backend"]) for s in summary)
    per_row = {
        f"{m}/{b}": {
            key: _per_row_us([s for s in summary if (s["model"], s["backend"]) == (m, b)], key)
            for key in ("ms_per_step", "cpu_ms_per_step")
        }
        for m, b in pairs
    }
    return {"summary": summary, "per_row_us": per_row}


def print_tables(payload: dict[str, Any]) -> None:
    rows = [
        {
            "model": s["model"], "rows": s["rows"], "backend": s["backend"], "ms": s["ms_per_step"],
            "speed": s["speed_vs_first_backend"], "cpu": s["cpu_ms_per_step"],
            "cpu_speed": s["cpu_speed_vs_first_backend"], "fwd": s["forwards_per_step"],
            **{k: s["profile_ms"].get(k) for k in TRL_CB_PHASES},
        }
        for s in payload["summary"]
    ]  # fmt: skip
    columns = [("model", "model"), ("rows", "rows"), ("backend", "backend"), ("ms", "ms/step"),
               ("speed", "speed vs first"), ("cpu", "cpu ms/step"), ("cpu_speed", "cpu speed"),
               ("fwd", "fwd/step")]  # fmt: skip
    columns += [(k, k.replace("attention_planning", "plan")) for k in TRL_CB_PHASES]
    print(common.format_table(rows, columns))
    for s in payload["summary"]:
        for kind, k in s.get("step_profile", {}).items():
            if k["steps_per_round"]:
                cells = " / ".join(f"{k['median_ms'][ph]:.3f}" for ph in STEP_PHASES)
                print(f"  {s['model']} {s['rows']} {s['backend']} {kind}: {k['steps_per_round']:.1f} steps/round, "
                      f"CPU ms per step {' / '.join(STEP_PHASES)}: {cells}")  # fmt: skip
    print("µs per added row per step:", json.dumps(payload["per_row_us"]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if common.other_mode(args, run_point, plots.render_engine_step):
        return {}
    backends = [*args.backends, *(f"trl_cb:{name}" for name in args.variants)]
    print(f"engine step sweep: models={args.models} rows={args.rows} backends={backends} threads={args.threads}")
    results = common.ResultFile("engine_step", args, summarize, plots.render_engine_step)
    print(f"points are written to {results.path} as they are measured", flush=True)
    with common.Workers(Path(__file__)) as workers:
        for n in range(args.passes):  # each pass runs every point again: a slow spell hits one pass
            for model in args.models:
                for rows in args.rows:
                    for backend in backends:  # interleaved: every backend of a point runs back to back
                        key = (model, rows, backend, n)
                        if results.has(key):
                            continue
                        spec = {
                            "model": model, "rows": rows, "backend": backend, "repeats": args.repeats,
                            "samples_per_prompt": args.samples_per_prompt, "prompt_len": args.prompt_len,
                            "max_new_tokens": args.max_new_tokens, "logit_scale": args.logit_scale,
                            "threads": args.threads, "seed": args.seed, "device": args.device, "dtype": args.dtype,
                            "profile_steps": args.profile_steps,
                            "cb_config": args.variants.get(backend.partition(":")[2], {}),
                        }  # fmt: skip
                        try:
                            point = workers.run(spec, group=f"{model}/{backend}", timeout=args.timeout)
                        except common.WorkerError as err:
                            results.fail(key, str(err))
                            continue
                        results.add(key, point)
                        print(f"  {model} rows={rows} {backend}: {statistics.median(point['step_ms']):.2f} ms/step",
                              flush=True)  # fmt: skip
    return results.finish(print_tables)


if __name__ == "__main__":
    main()
