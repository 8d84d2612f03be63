"""Where a decode step's time goes: host ms, device ms, kernels launched and device ms by kernel family, per step.

    python benchmarks/step_profile.py                                   # CPU: null model, 32 / 512 rows (~1 min)
    python benchmarks/step_profile.py --device cuda --model llama-1b-random --rows 32 256 1024 \\
        --prompt-len 16 560 --max-new-tokens 64                        # the GPU suite's profile

Method: for each (rows, prompt length) point, two engines on the same model, one generating `M` tokens per row and one
`2M` (no length tail: EOS is never sampled, `common.suppress_eos`); after a warm-up round of each, one round of each
under `torch.profiler` (CPU and, on CUDA, CUDA activities; every thread, since the engine steps on its own). The
per-step figures are the difference of the two rounds divided by `M`: the prefill, the engine's submission and the
collection cancel out, leaving `M` decode steps (at contexts `M/2` tokens longer on average than the first round's).
Reported per decode step: `host_ms` (wall, profiled), `device_ms` (kernel time; on CPU the engine thread's op time),
`kernels` (CUDA kernels launched, graph replays included; on CPU the torch ops the engine thread called, top level),
`device_ms_by_family` (matmul / attention / sampling / copies / other, from kernel names: a heuristic, the top kernels
are listed by name beside it), and with `--backends generate` the same for `model.generate()` (one padded call).
Results: a JSON in `--out` written after every point, and a table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

#: Kernel-name patterns per family, first match wins (names differ by device and library: cuBLAS/CUTLASS `gemm`,
#: cuBLASLt `nvjet`, torch's flash `flash`, trl_cb's Triton `paged_decode`, aten ops on CPU).
FAMILIES = (
    ("attention", r"flash|fmha|attn|attention|paged_decode|sdpa|_efficient"),
    ("matmul", r"gemm|gemv|cutlass|cublas|nvjet|xmma|matmul|aten::mm|aten::bmm|aten::addmm|aten::linear"),
    ("sampling", r"softmax|argmax|arg_max|uniform|exponential|distribution|sort|topk|cumsum|multinomial|log_"),
    ("copies", r"copy|memcpy|memset|index|gather|scatter|cat_|catarray|fill|aten::cat|aten::to|_to_copy"),
)
_PATTERNS = tuple((name, re.compile(pattern, re.I)) for name, pattern in FAMILIES)


def family(name: str) -> str:
    for fam, pattern in _PATTERNS:
        if pattern.search(name):
            return fam
    return "other"


def _kernels(prof: Any, cuda: bool) -> list[tuple[str, float]]:
    """(name, device ms) of every kernel (CUDA) or every top-level op of a non-main thread (CPU) in a profile."""
    from torch.autograd import DeviceType

    events = prof.events()
    if cuda:
        return [(e.name, e.time_range.elapsed_us() / 1000) for e in events if e.device_type == DeviceType.CUDA]
    ops = [
        e for e in events if e.device_type == DeviceType.CPU and e.cpu_parent is None and e.name.startswith("aten::")
    ]
    return [(e.name, e.cpu_time_total / 1000) for e in ops]


def _profiled(run: Any, cuda: bool) -> tuple[float, list[tuple[str, float]]]:
    """Run `run()` under torch.profiler: (wall s, kernels)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=activities, experimental_config=config) as prof:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return wall, _kernels(prof, cuda)


def _per_step(short: tuple[float, list], long: tuple[float, list], steps: int) -> dict[str, Any]:
    """The difference of the two rounds' profiles, per decode step."""

    def totals(kernels: list[tuple[str, float]]) -> tuple[dict[str, float], dict[str, float], dict[str, int]]:
        fam, by_name, count = defaultdict(float), defaultdict(float), defaultdict(int)
        for name, ms in kernels:
            fam[family(name)] += ms
            by_name[name] += ms
            count[name] += 1
        return fam, by_name, count

    fam_a, name_a, count_a = totals(short[1])
    fam_b, name_b, count_b = totals(long[1])
    per_name = {n: (name_b[n] - name_a.get(n, 0.0)) / steps for n in name_b}
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:12]
    families = [name for name, _ in FAMILIES] + ["other"]
    return {
        "host_ms": 1000 * (long[0] - short[0]) / steps,
        "device_ms": (sum(fam_b.values()) - sum(fam_a.values())) / steps,
        "kernels": (len(long[1]) - len(short[1])) / steps,
        "device_ms_by_family": {f: (fam_b.get(f, 0.0) - fam_a.get(f, 0.0)) / steps for f in families},
        "top_kernels": [
            {"name": n[:120], "ms": ms, "calls": (count_b[n] - count_a.get(n, 0)) / steps} for n, ms in top
        ],
    }


def run_point(args: argparse.Namespace, model: Any, tokenizer: Any, backend: str, rows: int, prompt_len: int) -> dict:
    import torch
    from transformers import GenerationConfig

    from trl_cb import ContinuousBatchingGenerator

    cuda = args.device.startswith("cuda")
    group, new = args.samples_per_prompt, args.max_new_tokens

    def config(tokens: int) -> GenerationConfig:
        return GenerationConfig(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=tokens,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip

    rng = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, len(tokenizer), (max(1, rows // group), prompt_len), generator=rng).tolist()
    batch = [p for p in prompts for _ in range(group)][:rows]
    if backend == "generate":
        ids = torch.tensor(batch, device=args.device)

        def rounds(tokens: int) -> Any:
            cfg = config(tokens)

            def run() -> None:
                with torch.no_grad():
                    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)

            return run

        runs, close = [rounds(new), rounds(2 * new)], list
    else:
        gens = [
            ContinuousBatchingGenerator(model, config(t), continuous_batching_config=args.cb_config)
            for t in (new, 2 * new)
        ]

        def rounds_cb(gen: Any) -> Any:
            return lambda: gen.generate(batch, num_generations=1)

        runs = [rounds_cb(g) for g in gens]

        def close(_: Any = None) -> None:
            for g in gens:
                g.close()

    try:
        for run in runs:  # warm-up: engines built, graphs captured
            run()
        short, long = (_profiled(run, cuda) for run in runs)
    finally:
        close()
        if cuda:
            torch.cuda.empty_cache()
    return {"backend": backend, "rows": rows, "prompt_len": prompt_len, **_per_step(short, long, new)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=None, help="a preset of common.PRESETS (default: null on CPU, llama-1b-random)")
    p.add_argument("--rows", type=int, nargs="+", default=[32, 512])
    p.add_argument("--prompt-len", type=int, nargs="+", default=[16])
    p.add_argument("--max-new-tokens", type=int, default=16, help="M: the rounds generate M and 2M tokens per row")
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--backends", nargs="+", default=["trl_cb"], choices=["trl_cb", "generate"])
    p.add_argument("--cb-config", type=json.loads, default={}, help="transformers_continuous_batching_config JSON")
    p.add_argument("--logit-scale", type=float, default=4.0)
    p.add_argument(
        "--decode-kernel", choices=["auto", "gather"], default="auto",
        help="gather: the block-table reference kernel even where a fused one would be chosen (for an A/B profile)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=common.DEFAULT_OUT)
    args = p.parse_args(argv)
    import torch

    cuda = args.device.startswith("cuda")
    if args.decode_kernel == "gather":
        from trl_cb.engine import cuda_kernels

        cuda_kernels.triton_available = lambda device, dtype: False
        cuda_kernels.paged_flash_available = lambda device, dtype, page_size: False
    model_name = args.model or ("llama-1b-random" if cuda else "null")
    model, tokenizer = common.load_model(model_name, args.device, "bfloat16" if cuda else "float32")
    with torch.no_grad():
        common.suppress_eos(model, tokenizer.eos_token_id, args.logit_scale)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.decode_kernel == "auto" else f"-{args.decode_kernel}"
    path = args.out / f"step_profile-{model_name}-{args.device.replace(':', '')}{suffix}.json"
    config = vars(args) | {"out": str(args.out)}
    result = {"environment": common.environment(args.device), "model": model_name, "config": config, "points": []}
    for prompt_len in args.prompt_len:
        for rows in args.rows:
            for backend in args.backends:
                point = run_point(args, model, tokenizer, backend, rows, prompt_len)
                result["points"].append(point)
                path.write_text(json.dumps(result, indent=1, default=str))
                fam = " ".join(f"{k}={v:.3f}" for k, v in point["device_ms_by_family"].items())
                print(
                    f"{backend:9s} rows={rows:5d} prompt={prompt_len:4d}: host {point['host_ms']:.3f} ms/step, "
                    f"device {point['device_ms']:.3f} ms/step, kernels {point['kernels']:.1f}/step | {fam}",
                    flush=True,
                )
                for k in point["top_kernels"][:6]:
                    print(f"    {k['ms']:.4f} ms  x{k['calls']:.1f}  {k['name']}", flush=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
