"""The block-table decode attention kernels on their own: ms per layer call of each kernel (`paged_decode.attend`,
replayed as a CUDA graph) and its gap to the reference, as rows and context grow.

    python benchmarks/decode_kernels.py --device cuda                 # gather vs triton (and flash where torch has it)
    python benchmarks/decode_kernels.py --rows 8 32 --contexts 40     # CPU: the reference alone, for the wiring

Shapes: Llama-3.2-1B's attention (32 query heads, 8 KV heads of 64), pages of `--page-size` tokens, each row
`context` keys deep (its pages at random places in the cache), a block table as wide as the engine would make it
(`ceil(context / page) + 1`, even). Every kernel reads the same inputs; `gap` is its largest output difference to the
reference (`gather`) in bf16 on CUDA (fp32 on CPU). The step profile (`step_profile.py`) shows what the kernel is
worth inside a whole decode step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def measure(kernel: str, query, layer_inputs: dict, device, repeats: int) -> tuple[float, object]:
    """(ms per call, output) of `kernel` on fresh copies of the inputs (each kernel writes the new keys)."""
    import torch

    from trl_cb.engine import paged_decode
    from trl_cb.engine.paged_decode import BlockTableLayer

    inputs = {k: v.clone() if k in ("key_pages", "value_pages") else v for k, v in layer_inputs.items()}
    layer = BlockTableLayer(**inputs, kernel=kernel)
    out = paged_decode.attend(query, layer, None)
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            paged_decode.attend(query, layer, None)
        return 1000 * (time.perf_counter() - start) / repeats, out
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_decode.attend(query, layer, None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = paged_decode.attend(query, layer, None)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        graph.replay()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start) / repeats, out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, nargs="+", default=[32, 256, 1024])
    p.add_argument("--contexts", type=int, nargs="+", default=[80, 600])
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=common.DEFAULT_OUT)
    args = p.parse_args(argv)
    import torch

    from trl_cb.engine import cuda_kernels

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernels = ["gather"]
    if cuda_kernels.triton_available(device, dtype):
        kernels.append("triton")
    if cuda_kernels.paged_flash_available(device, dtype, args.page_size):
        kernels.append("flash")
    heads, kv_heads, dim, page = 32, 8, 64, args.page_size
    g = torch.Generator().manual_seed(0)
    points = []
    for context in args.contexts:
        for rows in args.rows:
            width = -(-context // page) + 1
            width += width % 2
            num_pages = rows * width + 2  # pages 0-1: trash
            pages = torch.randperm(num_pages - 2, generator=g)[: rows * width].reshape(rows, width) + 2
            pages[:, -(-context // page) :] = -1
            shape = (num_pages, page, kv_heads, dim)
            layer_inputs = {
                "new_keys": torch.randn(rows, kv_heads, dim, generator=g).to(device, dtype),
                "new_values": torch.randn(rows, kv_heads, dim, generator=g).to(device, dtype),
                "key_pages": torch.randn(shape, generator=g).to(device, dtype),
                "value_pages": torch.randn(shape, generator=g).to(device, dtype),
                "block_table": pages.to(device, torch.int32),
                "cu_seq_lens_k": (torch.arange(rows + 1, dtype=torch.int32) * context).to(device),
                "write_trash": 0,
            }
            query = torch.randn(rows, heads, dim, generator=g).to(device, dtype)
            results = {k: measure(k, query, layer_inputs, device, args.repeats) for k in kernels}
            reference = results["gather"][1].float()
            point = {"rows": rows, "context": context}
            for k, (ms, out) in results.items():
                point[k] = {"ms_per_layer": ms, "gap": (out.float() - reference).abs().max().item()}
            points.append(point)
            line = ", ".join(f"{k} {point[k]['ms_per_layer']:.3f} ms (gap {point[k]['gap']:.1e})" for k in kernels)
            print(f"context {context:5d}, rows {rows:5d}: {line}", flush=True)
            del layer_inputs, results
            if device.type == "cuda":
                torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode_kernels-{device.type}.json"
    path.write_text(json.dumps({"environment": common.environment(args.device), "points": points}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
