"""Decode graphs on a real GPU (`pytest -m gpu`): CUDA graphs replay what they captured, so what the CPU tests check
through a fake backend (tests/unit/engine/test_decode_graphs.py) is checked here against the real thing: exact
sampling in fp32 and to the bf16 floor, graphs kept across optimizer steps, a moved weight re-captured, and the
stale replay caught by the control."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import sampling_config
from tests.unit.engine.test_attention import _config, _far_from_uniform
from tests.unit.engine.test_decode_graphs import G, _graphs
from trl_cb import ContinuousBatchingGenerator
from trl_cb.engine import _upstream_cache, cuda_kernels, decode_graphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: bf16 sampling vs a bf16 teacher-forced forward of the same weights: the bound of the existing bf16 GPU test
#: (tests/unit/engine/test_attention.py) on the same model.
BF16_TOLERANCE = 0.1


def _model(tokenizer, dtype: torch.dtype) -> torch.nn.Module:
    """The GPU exactness test's model (tests/unit/engine/test_attention.py): 4 layers, weights far from uniform."""
    return _far_from_uniform(_config("qwen2", tokenizer)).to("cuda", dtype)


def _worst(model: torch.nn.Module, prompts: list[list[int]], result) -> float:
    """Largest gap to a teacher-forced forward (T = 1, no truncation) of the same weights on the same device."""
    worst = 0.0
    for i, (completion, logprobs) in enumerate(zip(result.completion_ids, result.logprobs, strict=True)):
        prompt = prompts[i // result.num_generations]
        ids = torch.tensor([prompt + completion], device=model.device)
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # (T, V)
        ref = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0].cpu()
        worst = max(worst, (ref - torch.tensor(logprobs)).abs().max().item())
    return worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graphs_sample_exactly_and_survive_optimizer_steps(tokenizer, prompts, dtype):
    model = _model(tokenizer, dtype)
    tolerance = 1e-4 if dtype == torch.float32 else BF16_TOLERANCE
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer)) as gen:
        result = gen.generate(prompts, num_generations=G)
        graphs = _graphs(gen)
        assert graphs is not None, "CUDA engines run their decode steps as graphs by default"
        assert graphs.replays > 0
        kernel = _upstream_cache.kernels_of(gen._pool.engine.manager.batch_processor.cache)
        print(f"kernel: {kernel}, paged flash: {cuda_kernels.paged_flash_available(model.device, dtype, 256)}")
        assert _worst(model, prompts, result) < tolerance
        captured = graphs.captures
        for _ in range(10):
            ids = torch.tensor([prompts[0]], device="cuda")
            model.train()
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            model.eval()
            result = gen.generate(prompts, num_generations=G)
            assert _worst(model, prompts, result) < tolerance
        assert graphs.invalidations == 0
        assert graphs.captures <= captured + 2


@pytest.mark.parametrize("recheck", [True, False], ids=["recaptured", "control-stale-replay"])
def test_cuda_moved_weight_is_recaptured(tokenizer, prompts, monkeypatch, recheck):
    if not recheck:
        monkeypatch.setattr(decode_graphs.DecodeGraphs, "check", lambda self, module: False)
    model = _model(tokenizer, torch.float32)
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer)) as gen:
        gen.generate(prompts, num_generations=G)
        weight = model.model.layers[0].mlp.down_proj.weight
        old = weight.data  # kept alive: a stale replay reads these (old) values, deterministically
        weight.data = old.clone() * 1.5
        result = gen.generate(prompts, num_generations=G)
        graphs = _graphs(gen)
    del old
    worst = _worst(model, prompts, result)
    if recheck:
        assert graphs.invalidations == 1 and worst < 1e-4
    else:
        assert worst > 0.1


def test_flash_kernels_agree_with_the_reference_where_available():
    device = torch.device("cuda")
    if not cuda_kernels.paged_flash_available(device, torch.bfloat16, 256):
        pytest.skip("this torch's varlen_attn reads no block tables")
    assert cuda_kernels._paged_gap(device, torch.bfloat16, 256, 8, 2, 64) < cuda_kernels.TOLERANCE
    assert cuda_kernels._packed_gap(device, torch.bfloat16, 8, 2, 64) < cuda_kernels.TOLERANCE
    assert cuda_kernels.choose(device, torch.bfloat16, 256, 8, 2, 64) == cuda_kernels.Kernels(
        cuda_kernels.FLASH, cuda_kernels.FLASH
    )


def test_triton_decode_kernel_agrees_with_the_reference_on_cuda():
    """trl_cb's Triton decode kernel is within the reference's half-precision noise on the model shapes users run
    (it reads the pages in place; not chosen by engines yet, docs/benchmarks.md)."""
    device = torch.device("cuda")
    for page, heads, kv, dim in [(64, 32, 8, 64), (64, 8, 2, 256), (256, 14, 2, 64)]:
        gap = cuda_kernels._paged_gap(device, torch.bfloat16, page, heads, kv, dim, cuda_kernels.TRITON)
        assert gap < cuda_kernels.TOLERANCE, (page, heads, kv, dim, gap)


#: The device the cache-layout test runs on (a CPU run of its body, with tests/graph_fakes.py, checks the test itself).
DEVICE = "cuda"


def _layout_model(family: str, tokenizer) -> torch.nn.Module:
    """A windowed family of test_attention.py's configs (12-token windows), or a model-zoo layout (Gemma 4,
    DeepSeek-V3: tests/model_zoo.py); weights far from uniform, fp32."""
    if family in ("gemma4_text", "deepseek_v3"):
        from tests.model_zoo import SUPPORTED, tiny_arch_model

        arch = next(a for a in SUPPORTED if a.model_type == family)
        special = {k: getattr(tokenizer, k) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
        return tiny_arch_model(arch, len(tokenizer), special)
    return _far_from_uniform(_config(family, tokenizer))


@pytest.mark.parametrize(
    ("family", "dtype"),
    [("mistral", torch.float32), ("mistral", torch.bfloat16), ("gemma3", torch.float32), ("gpt_oss", torch.float32),
     ("gemma4_text", torch.float32), ("deepseek_v3", torch.float32)],
    ids=["mistral-fp32", "mistral-bf16", "gemma3", "gpt_oss", "gemma4", "deepseek_v3"],
)  # fmt: skip
def test_cuda_graphs_on_every_cache_layout(tokenizer, prompts, family, dtype):
    """Sliding-window rings (Mistral every layer, Gemma 3 alternating, gpt-oss with sinks), Gemma 4's KV-shared
    layers of two shapes and DeepSeek-V3's gathered latents under real CUDA graphs, where a host read or a shape that
    changes between replays fails or goes wrong (the CPU fake replays eagerly): exact in fp32, to the bf16 floor in
    bf16, on 16-token pages the sequences wrap, across three optimizer steps (lr > 0) without a re-capture."""
    model = _layout_model(family, tokenizer).to(DEVICE, dtype)
    tolerance = 1e-4 if dtype == torch.float32 else BF16_TOLERANCE
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer), {"page_size": 16}) as gen:
        for _ in range(3):
            result = gen.generate(prompts, num_generations=G)
            assert _worst(model, prompts, result) < tolerance
            ids = torch.tensor([prompts[0]], device=DEVICE)
            model.train()
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            model.eval()
        graphs = _graphs(gen)
        assert graphs is not None and graphs.replays > 0 and graphs.invalidations == 0
