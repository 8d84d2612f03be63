"""`engine/weight_export.py` and `sharding.iter_full_parameters`: the weights a rollout server receives.

Single process: plain names and tensors as `named_parameters()`; PEFT LoRA merged (equal to peft's own
`merge_and_unload`) under the base model's names, `modules_to_save` copies sent under the original names, the
training weights untouched; a disabled adapter sends the base; DoRA refused. Two processes (gloo, FSDP2 `fully_shard`
on CPU): every rank yields whole tensors equal to the unsharded model's, LoRA merged over DTensors, and the specs
(known without a collective) describe them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from tests.gloo_workers import run_two_workers
from trl_cb.engine.sharding import iter_full_parameters
from trl_cb.engine.weight_export import iter_weights, weight_specs
from trl_cb.offline.tiny import tiny_model, tiny_tokenizer


def lora_model(base: torch.nn.Module, **extra: object) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **extra)
    return get_peft_model(copy.deepcopy(base), config)


def test_plain_model_is_sent_as_named_parameters(tokenizer):
    model = tiny_model(tokenizer)
    params = list(model.named_parameters())
    specs = weight_specs(model)
    assert [(s.name, s.dtype, s.shape) for s in specs] == [(n, p.dtype, tuple(p.shape)) for n, p in params]
    sent = list(iter_weights(model))
    assert [n for n, _ in sent] == [n for n, _ in params]
    assert all(torch.equal(t, p) for (_, t), (_, p) in zip(sent, params))
    assert [n for n, _ in iter_full_parameters(params)] == [n for n, _ in params]


def test_lora_is_merged_under_the_base_names(tokenizer):
    pytest.importorskip("peft")
    base = tiny_model(tokenizer)
    peft_model = lora_model(base, modules_to_save=["lm_head"])
    with torch.no_grad():  # the trained copy of lm_head differs from the original
        peft_model.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.5)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    plain = peft_model.get_base_model()
    sent = {name: tensor.clone() for name, tensor in iter_weights(plain)}
    expected = dict(copy.deepcopy(peft_model).merge_and_unload().named_parameters())
    assert [s.name for s in weight_specs(plain)] == [n for n, _ in base.named_parameters()] == list(sent)
    assert all(torch.equal(sent[n], expected[n]) for n in expected), "peft's own merge, bit for bit"
    changed = [n for n, p in base.named_parameters() if not torch.equal(sent[n], p)]
    assert len(changed) == 5 and "lm_head.weight" in changed  # 2 layers x (q, v), and the modules_to_save copy
    assert all(torch.equal(before[n], p) for n, p in peft_model.named_parameters()), "training weights untouched"
    with peft_model.disable_adapter():
        assert all(torch.equal(t, dict(base.named_parameters())[n]) for n, t in iter_weights(plain))


def test_dora_is_refused(tokenizer):
    pytest.importorskip("peft")
    plain = lora_model(tiny_model(tokenizer), use_dora=True).get_base_model()
    with pytest.raises(NotImplementedError, match="DoRA"):
        list(iter_weights(plain))


def _fsdp2_worker(rank: int, port: int, out: str) -> None:
    """One of two ranks: shard a model (and a LoRA model) with FSDP2, export, compare with the unsharded copy."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tokenizer = tiny_tokenizer()
        report = {}
        for kind in ("plain", "lora"):
            base = tiny_model(tokenizer, init_std=0.2)  # the same weights on both ranks (seeded)
            torch.manual_seed(0)  # and the same LoRA init: each rank keeps its shard of its own copy
            model = base if kind == "plain" else lora_model(base)
            plain = model if kind == "plain" else model.get_base_model()
            expected = dict(copy.deepcopy(model).merge_and_unload().named_parameters() if kind == "lora" else [])
            expected = expected or {n: p.detach().clone() for n, p in model.named_parameters()}
            for layer in plain.model.layers:
                fully_shard(layer)
            fully_shard(plain)
            sharded = sum(isinstance(p, DTensor) for p in model.parameters())
            specs = weight_specs(plain)
            sent = [(name, tensor.clone()) for name, tensor in iter_weights(plain)]
            report[kind] = {
                "sharded": sharded,
                "num_params": len(list(model.parameters())),
                "names_match": [n for n, _ in sent] == [s.name for s in specs] == list(expected),
                "shapes_match": all(tuple(t.shape) == s.shape for (_, t), s in zip(sent, specs)),
                "max_diff": max((t - expected[n]).abs().max().item() for n, t in sent),
                "local": all(not isinstance(t, DTensor) for _, t in sent),
            }
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def test_fsdp2_dtensors_are_gathered_one_at_a_time(tmp_path):
    pytest.importorskip("peft")
    run_two_workers(_fsdp2_worker, tmp_path, "FSDP2 export")
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for kind, r in report.items():
            print(rank, kind, r)
            assert r["sharded"] == r["num_params"], "every parameter is a DTensor"
            assert r["names_match"] and r["shapes_match"] and r["local"]
            assert r["max_diff"] <= (0.0 if kind == "plain" else 1e-6), (kind, r)
