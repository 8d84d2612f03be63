"""Block-table decode attention (`trl_cb.engine.paged_decode`) against a per-row reference that reads the pages in
order, on random paged batches: rows of 1 key, a page, a page + 1 and several pages, GQA and MHA, soft-cap, sinks,
a padding row. The new key must land at its row's position and nowhere else."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from trl_cb.engine import cuda_kernels, paged_decode
from trl_cb.engine.paged_decode import BlockTableLayer

PAGE = 4


def _batch(num_kv: int, heads: int, dim: int = 8, seed: int = 0) -> tuple[BlockTableLayer, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, PAGE, PAGE + 1, 3 * PAGE - 1, 0]  # keys per row after this step's write; 0: a padding row
    max_pages, num_pages = 3, 16
    table = torch.full((len(lengths), max_pages), -1, dtype=torch.int32)
    free = (torch.randperm(num_pages - 2, generator=g) + 2).tolist()  # pages 0-1: trash
    for row, length in enumerate(lengths):
        for page in range(-(-length // PAGE)):
            table[row, page] = free.pop()
    cu_k = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_k[1:] = torch.tensor(lengths).cumsum(0)
    shape = (num_pages, PAGE, num_kv, dim)
    layer = BlockTableLayer(
        new_keys=torch.randn(len(lengths), num_kv, dim, generator=g) * 3,
        new_values=torch.randn(len(lengths), num_kv, dim, generator=g),
        key_pages=torch.randn(shape, generator=g) * 3,
        value_pages=torch.randn(shape, generator=g),
        block_table=table,
        cu_seq_lens_k=cu_k,
        write_trash=PAGE,  # first row of page 1 (trash)
    )
    return layer, torch.randn(len(lengths), heads, dim, generator=g) * 3


def _reference(query, layer, scaling, softcap, sinks, position_shift=0):
    """Each row's keys read page by page in block-table order, its new key at `len - 1 + position_shift`."""
    keys, values = layer.key_pages.clone(), layer.value_pages.clone()
    out = torch.zeros(query.shape[0], query.shape[1], values.shape[-1])
    n_rep = query.shape[1] // keys.shape[2]
    for row, length in enumerate(layer.seq_lens.tolist()):
        if length == 0:
            continue
        pos = length - 1 + position_shift
        keys[layer.block_table[row, pos // PAGE], pos % PAGE] = layer.new_keys[row]
        values[layer.block_table[row, pos // PAGE], pos % PAGE] = layer.new_values[row]
        k = torch.cat([keys[p] for p in layer.block_table[row] if p >= 0])[:length]  # (L, Hkv, D)
        v = torch.cat([values[p] for p in layer.block_table[row] if p >= 0])[:length]
        k, v = k.repeat_interleave(n_rep, 1).transpose(0, 1), v.repeat_interleave(n_rep, 1).transpose(0, 1)
        scores = (query[row][:, None, :] @ k.transpose(-1, -2))[:, 0] * scaling  # (H, L)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if sinks is not None:
            scores = torch.cat([scores, sinks[:, None]], dim=-1)
        probs = scores.softmax(-1)[:, :length]
        out[row] = (probs[:, None, :] @ v)[:, 0]
    return out


@pytest.mark.parametrize("variant", ["plain", "softcap", "sinks"])
@pytest.mark.parametrize("num_kv", [4, 2], ids=["MHA", "GQA"])
def test_gather_kernel_matches_the_page_by_page_reference(variant, num_kv):
    layer, query = _batch(num_kv, heads=4)
    softcap = 2.0 if variant == "softcap" else None
    sinks = torch.randn(4) * 2 if variant == "sinks" else None
    want = _reference(query, layer, 0.5, softcap, sinks)
    pages_before = layer.key_pages.clone()
    got = paged_decode.attend(query, layer, 0.5, softcap, sinks)
    real = layer.seq_lens > 0
    assert (got[real] - want[real]).abs().max().item() < 1e-5
    assert torch.isfinite(got).all(), "a padding row's output must stay finite"
    # The new keys were written at each row's position, the padding row's into the trash row (page 1, slot 0) only.
    changed = {tuple(c) for c in (layer.key_pages != pages_before).any(-1).any(-1).nonzero().tolist()}
    lengths = layer.seq_lens.tolist()
    expected = {(int(layer.block_table[r, (n - 1) // PAGE]), (n - 1) % PAGE) for r, n in enumerate(lengths) if n}
    assert changed == expected | {(1, 0)}
    # Control: writing the new key one position late changes the result beyond the tolerance.
    layer2, _ = _batch(num_kv, heads=4)
    late = _reference(query, layer2, 0.5, softcap, sinks, position_shift=-1)
    assert (late[real] - got[real]).abs().max().item() > 0.1


def test_flash_is_refused_where_it_cannot_run():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not cuda_kernels.flash_available(cpu, torch.bfloat16)
    assert cuda_kernels.choose(cpu, torch.bfloat16, 256, 4, 2, 16) == cuda_kernels.REFERENCE_KERNELS
    assert not cuda_kernels.flash_available(cuda, torch.float32), "flash kernels take fp16/bf16 only"
    assert not cuda_kernels.paged_flash_available(cuda, torch.bfloat16, 32), "paged flash reads pages of 256k tokens"
    assert cuda_kernels.choose(cuda, torch.bfloat16, 256, 4, 2, 16, softcap=30.0) == cuda_kernels.REFERENCE_KERNELS


@pytest.fixture
def triton_interpreter():
    """trl_cb's Triton decode kernel, run by Triton's CPU interpreter off a GPU (tests/conftest.py sets it up)."""
    pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it on Linux x86-64)")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("Triton's interpreter must be switched on before triton is imported (tests/conftest.py)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_kv,heads", [(4, 4), (2, 4), (1, 20)], ids=["MHA", "GQA", "MQA-20"])
def test_triton_kernel_reads_pages_in_place_exactly(triton_interpreter, num_kv, heads, dtype):
    """The Triton kernel against the page-by-page reference (float64 truth), with a padding row, rows across page
    boundaries and a block table whose unused entries are -1; the gather reference in the same dtype as a yardstick.
    Query heads per KV head beyond one `tl.dot` tile (20) check the head padding."""
    layer, query = _batch(num_kv, heads, dim=24)  # a head size that is not a power of two: masked columns
    layer.key_pages, layer.value_pages = layer.key_pages.to(dtype), layer.value_pages.to(dtype)
    layer.new_keys, layer.new_values = layer.new_keys.to(dtype), layer.new_values.to(dtype)
    truth = _reference(query.double(), _as_double(layer), 0.3, None, None)
    gather_layer = _copy(layer)
    gather = paged_decode.attend(query.to(dtype), gather_layer, 0.3)  # the reference kernel, same inputs
    layer.kernel = "triton"
    got = paged_decode.attend(query.to(dtype), layer, 0.3)
    real = layer.seq_lens > 0
    error, yardstick = _gap(got, truth, real), _gap(gather, truth, real)
    assert error <= max(1e-5, 1.01 * yardstick), (error, yardstick)
    assert torch.isfinite(got).all(), "a padding row's output must stay finite"
    # The new keys landed where the reference kernel writes them (the padding row's in the trash row), and only there.
    assert torch.equal(layer.key_pages, gather_layer.key_pages)
    assert torch.equal(layer.value_pages, gather_layer.value_pages)
    # Control: row 3's first page pointed at row 2's: the kernel reads other keys and row 3 is far off.
    wrong = _copy(layer)
    wrong.kernel = "triton"
    wrong.block_table[3, 0] = layer.block_table[2, 0]
    off = paged_decode.attend(query.to(dtype), wrong, 0.3)
    assert _gap(off[3:4], truth[3:4], torch.tensor([True])) > 0.1


def _as_double(layer: BlockTableLayer) -> BlockTableLayer:
    out = _copy(layer)
    out.key_pages, out.value_pages = out.key_pages.double(), out.value_pages.double()
    out.new_keys, out.new_values = out.new_keys.double(), out.new_values.double()
    return out


def _copy(layer: BlockTableLayer) -> BlockTableLayer:
    import dataclasses

    fields = {f.name: getattr(layer, f.name) for f in dataclasses.fields(layer)}
    cloned = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
    return BlockTableLayer(**{**cloned, "kernel": "gather"})


def _gap(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> float:
    return (a.double()[rows] - b.double()[rows]).abs().max().item()


def test_choose_prefers_flash_then_triton_and_only_what_passed_its_check(monkeypatch):
    """The decode kernel: flash where torch reads block tables and it agrees, else the reference (Triton is not chosen:
    its bf16 gap to the trainer's forward on a GPU, docs/benchmarks.md); a kernel that raises or disagrees is never
    chosen. Packed steps: flash only where it agrees."""
    cuda = torch.device("cuda")
    gaps = {"flash": 1e-3, "triton": 1e-3}

    def paged_gap(device, dtype, page, heads, kv, dim, kernel):
        if gaps[kernel] is None:
            raise RuntimeError("kernel failed")
        return gaps[kernel]

    monkeypatch.setattr(cuda_kernels, "_paged_gap", paged_gap)
    monkeypatch.setattr(cuda_kernels, "_packed_gap", lambda *args: 1.0)  # packed flash disagrees
    monkeypatch.setattr(cuda_kernels, "flash_available", lambda device, dtype: True)
    monkeypatch.setattr(cuda_kernels, "triton_available", lambda device, dtype: True)
    monkeypatch.setattr(cuda_kernels, "paged_flash_available", lambda device, dtype, page: True)
    choose = functools.partial(cuda_kernels.choose, cuda, torch.bfloat16, 64, 32, 8, 64)
    assert choose() == cuda_kernels.Kernels(cuda_kernels.REFERENCE, cuda_kernels.FLASH)
    gaps["flash"] = None  # flash fails its check: the reference (Triton is not chosen yet, even where it agrees)
    assert choose() == cuda_kernels.REFERENCE_KERNELS
    monkeypatch.setattr(cuda_kernels, "_packed_gap", lambda *args: 1e-3)
    monkeypatch.setattr(cuda_kernels, "paged_flash_available", lambda device, dtype, page: False)
    assert choose() == cuda_kernels.Kernels(cuda_kernels.FLASH, cuda_kernels.REFERENCE)
