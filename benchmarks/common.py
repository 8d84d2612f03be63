"""Shared benchmark plumbing: isolated worker processes, statistics, environment capture, tables, JSON.

Why isolation: TRL's native CB call pattern sizes its cache from system memory and leaves a CPU process slow for a
while afterwards (docs/index.md, "Sizing"); measured in one process, it would slow whatever backend runs next. Every
(backend, point) therefore runs in a fresh `python` subprocess that prints one JSON document as its last line.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: Where a run writes its JSON and PNG unless `--out` says otherwise: `runs/benchmarks/` at the repository root, which
#: git ignores (`/runs/`), so a user's run never changes the checkout. The results the docs cite are tracked in
#: `benchmarks/results/`; maintainers record them there with `--out benchmarks/results` (docs/benchmarks.md).
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "runs" / "benchmarks"
OUT_HELP = "directory for the result files (default: runs/benchmarks/, git-ignored; cited results: benchmarks/results)"
#: Random-init CPU presets (offline): `tiny` (64 wide, 2 layers), `small` (256 wide, 8 layers) and `tiny-qwen3.5`
#: (64 wide, Qwen3.5's hybrid layout: 3 Gated DeltaNet layers + 1 full-attention layer; offline/tiny.py).
CPU_PRESETS = ("tiny", "small", "tiny-qwen3.5")
#: Presets with recurrent layers (trl_cb keeps their state per sequence; transformers' own CB engine, which TRL's
#: native call uses, refuses them: "Invalid layer type: linear_attention").
HYBRID_PRESETS = ("tiny-qwen3.5", "qwen3.5-0.8b-random")
#: EOS logit bias per random preset (`--eos-logit-bias` default): long-tailed completion lengths on GSM8K-style
#: prompts (tiny at 4.0: p50 ~30, p90 ~90 tokens). `small`'s deeper stack needs more for a similar tail, `tiny-qwen3.5`
#: less (2.0: p50 18, p90 76 on 64 samples).
EOS_BIAS = {"tiny": 4.0, "small": 6.0, "tiny-qwen3.5": 2.0, "llama-1b-random": 4.0, "qwen3.5-0.8b-random": 4.0}


def cpu_preset(name: str, eos_logit_bias: float | None, dtype: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer) for a `CPU_PRESETS` name: random init, EOS-biased, local tokenizer (no download)."""
    import torch

    from trl_cb.offline.tiny import small_model, tiny_model, tiny_tokenizer

    if name not in CPU_PRESETS:
        raise ValueError(f"unknown CPU preset {name!r}; choose from {CPU_PRESETS}")
    tokenizer = tiny_tokenizer()
    kwargs = {"eos_logit_bias": eos_logit_bias, "dtype": dtype or torch.float32}
    if name == "tiny-qwen3.5":
        return tiny_model(tokenizer, architecture="qwen3_5", num_layers=4, **kwargs), tokenizer
    return (tiny_model if name == "tiny" else small_model)(tokenizer, **kwargs), tokenizer


def qwen3_5_08b_random(dtype: Any, device: Any, eos_logit_bias: float | None) -> tuple[Any, Any]:
    """(model, tokenizer): Qwen3.5-0.8B's text layout at full size, random init (no hub), on `device`, eval mode.

    24 layers of 1,024 (18 Gated DeltaNet, every 4th full attention with 8 query / 2 KV heads of 256), MLP 3,584,
    the tied 248,320-entry vocabulary; the Gated DeltaNet heads (16 key, 16 value, 128 wide) are this preset's
    assumption. The local tokenizer covers the first 4,096 ids; the LM head is untied so that `eos_logit_bias`
    (None: plain init) moves the EOS row only (as `llama_1b_random`).
    """
    from transformers import Qwen3_5TextConfig

    from trl_cb.offline.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer(vocab_size=4096)
    config = Qwen3_5TextConfig(
        vocab_size=248_320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    return _random_full_size(config, tokenizer, dtype, device, eos_logit_bias)


def llama_1b_random(dtype: Any, device: Any, eos_logit_bias: float | None) -> tuple[Any, Any]:
    """(model, tokenizer): Llama-3.2-1B at full size, random init (no hub), on `device`, eval mode.

    Its 128,256-entry vocabulary makes the LM head and sampling cost what they cost on the real model; the local
    tokenizer covers the first 4,096 ids (prompts, EOS, pad). The LM head is untied from the embedding so that
    `eos_logit_bias` (None: plain init) moves the EOS row only.
    """
    from transformers import LlamaConfig

    from trl_cb.offline.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer(vocab_size=4096)
    config = LlamaConfig(
        vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    return _random_full_size(config, tokenizer, dtype, device, eos_logit_bias)


def _random_full_size(config: Any, tokenizer: Any, dtype: Any, device: Any, eos_logit_bias: float | None) -> tuple:
    """(model, tokenizer): `config` random-init (seed 0) on `device`, LM head untied, EOS biased, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from trl_cb.offline.tiny import bias_eos

    torch.manual_seed(0)
    with torch.device(device):  # random init where the model runs: seconds on a GPU, not a minute on a CPU
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    if eos_logit_bias is not None:
        bias_eos(model, tokenizer.eos_token_id, eos_logit_bias)
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(model.generation_config, key, getattr(tokenizer, key))
    return model.eval(), tokenizer


@contextmanager
def background_load(num_processes: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Keep `num_processes` busy-looping Python processes running for the duration of the block.

    Why: on a shared machine other jobs compete for the cores, and CPU thread pools that spin while waiting behave
    very differently then (docs/benchmarks.md, "Threads and load"). This reproduces that condition on demand. Only
    the processes started here are stopped on exit, each by its own handle.
    """
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(num_processes)
    ]
    try:
        if procs:
            time.sleep(0.2)  # let them get scheduled before measuring
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


@contextmanager
def served_model(
    model: Any, tokenizer: Any, threads: int, device: str = "cpu", dtype: str = "float32"
) -> Iterator[str]:
    """A local `trl-cb serve` replica (`threads` torch threads, on `device` in `dtype`) holding a copy of `model`;
    yields its URL.

    The server backends of the benchmarks use it: the model is saved to a temporary directory the server loads. The
    trainer pushes its own weights before the first sample, so the copy only fixes the architecture."""
    import tempfile

    from trl_cb.serving.launch import local_rollout_server

    with tempfile.TemporaryDirectory(prefix="trl_cb_served_") as directory:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        extra = ["--device", device, "--dtype", dtype]
        with local_rollout_server(directory, threads=threads, extra_args=extra) as server:
            yield server.url


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean/std/min/max of a list of measurements (std 0 for a single value)."""
    vals = list(values)
    return {
        "mean": statistics.fmean(vals),
        "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
        "min": min(vals),
        "max": max(vals),
    }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return float(ordered[rank])


def environment(device: str) -> dict[str, Any]:
    """Machine and versions, so a result file says where and with what it was measured."""
    import torch
    import transformers
    import trl

    import trl_cb

    if device.startswith("cuda") and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name(0)
    else:
        device_name = f"cpu: {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "device": device_name,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "trl_cb": trl_cb.__version__,
        "git_commit": commit,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_worker(script: Path, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run `script --worker SPEC` in a fresh interpreter and return the JSON document it prints last."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(script), "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"benchmark worker {spec.get('backend')} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1])


def format_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """A plain-text table: `columns` is [(key, header)]; floats get 3 significant decimals."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return "-" if value is None else str(value)

    table = [[header for _, header in columns]] + [[cell(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(payload: dict[str, Any], out_dir: Path, stem: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def record_call_times(obj: Any, name: str) -> list[float]:
    """Replace the method `obj.<name>` by a wrapper that appends each call's wall-clock seconds to the returned list.

    The benchmarks use it to time the trainer's wait for rollouts inside a step (the generation call, or the wait for
    finished async groups) without changing what the call does or returns.
    """
    times: list[float] = []
    original = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - start)

    setattr(obj, name, timed)
    return times


def redraw_main(render: Callable[[Path, Path], Path], description: str | None) -> None:
    """Command line of the plot scripts: a result JSON in, its PNG written next to it (or to `--out`)."""
    import argparse

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json_path", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: next to the JSON)")
    args = parser.parse_args()
    if not args.json_path.is_file():
        parser.error(f"no such file: {args.json_path}")
    print(render(args.json_path, args.out or args.json_path.with_suffix(".png")))
