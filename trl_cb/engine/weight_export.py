"""The weights a rollout server holds, read from a training model: the plain transformers model's parameter names,
whole tensors one at a time on every rank, PEFT LoRA adapters merged in.

Invariants: `weight_specs` (names, dtypes, whole shapes) needs no collective and lists exactly what `iter_weights`
then yields, in the same order, so a receiver allocates before the first tensor is broadcast. `iter_weights` is a
collective under ZeRO-3 / FSDP2 (every rank iterates to the end over the same model); it holds one parameter, or one
LoRA layer (base weight and its adapters' A and B), whole at a time (`engine/sharding.py`), never the model. It never
changes the training model: a merged weight is computed into a new tensor (`W + ΔW`, peft's own `get_delta_weight`),
so no merge/unmerge round trip perturbs `W` by rounding. Names follow TRL's vLLM sync: PEFT's `.base_layer`, `lora_*`
parameters and `modules_to_save` originals disappear; `_checkpoint_wrapped_module.` too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import sharding

__all__ = ["WeightSpec", "iter_weights", "weight_specs"]

_LORA_CONTAINERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


@dataclass(frozen=True)
class WeightSpec:
    """One tensor a server receives: its name in the plain model, dtype (the trainer's) and whole shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Entry:
    name: str
    param: torch.Tensor
    lora_layer: torch.nn.Module | None = None  # add its adapters' ΔW to `param`
    adapters: tuple[str, ...] = ()

    def gathered_with(self) -> list[torch.Tensor]:
        """`param` and the adapter tensors its merge reads: what must be whole together."""
        extra = []
        for adapter in self.adapters:
            for container in _LORA_CONTAINERS:
                held = getattr(self.lora_layer, container, None)
                if held is not None and adapter in held:
                    item = held[adapter]
                    extra += list(item.parameters()) if isinstance(item, torch.nn.Module) else [item]
        return [self.param, *extra]


def _peft_types() -> tuple[type, type, type] | None:
    try:
        from peft.tuners.lora import LoraLayer
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:
        return None
    return LoraLayer, BaseTunerLayer, ModulesToSaveWrapper


def _merged_adapters(layer: torch.nn.Module) -> tuple[str, ...]:
    """The LoRA adapters whose ΔW the forward adds and the base weight does not hold yet; refuses merge rules other
    than `W + ΔW` (DoRA and other variants, LoRA biases) rather than send wrong weights."""
    if layer.disable_adapters:
        return ()
    adapters = tuple(
        a
        for a in layer.active_adapters
        if a not in layer.merged_adapters and any(a in getattr(layer, c, {}) for c in _LORA_CONTAINERS)
    )
    for adapter in adapters:
        variant = getattr(layer, "lora_variant", {}).get(adapter) or getattr(layer, "use_dora", {}).get(adapter)
        if variant or getattr(layer, "lora_bias", {}).get(adapter):
            raise NotImplementedError(
                f"weight push for LoRA adapter {adapter!r}: only plain LoRA (W + BA·scale) is merged; DoRA, other "
                "variants and lora_bias are not built yet."
            )
    return adapters


def _entries(model: torch.nn.Module) -> list[_Entry]:
    """Every parameter the plain model holds, under its name, in `named_parameters()` order, shared ones once."""
    peft = _peft_types()
    entries: list[_Entry] = []
    seen: set[int] = set()
    merges: dict[int, tuple[torch.nn.Module, tuple[str, ...]]] = {}

    def visit(module: torch.nn.Module, prefix: str) -> None:
        if peft is not None:
            lora_layer, tuner_layer, modules_to_save = peft
            if isinstance(module, lora_layer):
                adapters = _merged_adapters(module)
                if adapters:
                    merges[id(module.get_base_layer().weight)] = (module, adapters)
                visit(module.get_base_layer(), prefix)  # `.base_layer` and the `lora_*` children disappear
                return
            if isinstance(module, tuner_layer):
                raise NotImplementedError(f"weight push for PEFT layer {type(module).__name__}: only LoRA is built.")
            if isinstance(module, modules_to_save):  # the trained copy when active, else the original
                active = [a for a in module.active_adapters if a in module.modules_to_save]
                use_copy = active and not module.disable_adapters
                visit(module.modules_to_save[active[0]] if use_copy else module.original_module, prefix)
                return
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                layer, adapters = merges.get(id(param), (None, ()))
                entries.append(_Entry(prefix + name, param, layer, adapters))
        for name, child in module.named_children():
            visit(child, prefix if name == "_checkpoint_wrapped_module" else f"{prefix}{name}.")

    visit(model, "")
    return entries


def weight_specs(model: torch.nn.Module) -> list[WeightSpec]:
    """What `iter_weights(model)` yields, in order, known on every rank without a collective.

    `model`: the plain transformers model (for PEFT, the base model with the LoRA layers injected:
    `rollouts.model_access.plain_module`)."""
    return [WeightSpec(e.name, e.param.dtype, sharding.full_shape(e.param)) for e in _entries(model)]


def iter_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, whole tensor)` per `weight_specs(model)` entry, LoRA merged; on every rank (a collective when sharded).

    A tensor is valid until the next is requested; it may be the training parameter itself (no copy): read it,
    never write it."""
    for entry in _entries(model):
        with sharding.gathered(entry.gathered_with()):
            weight = sharding.full_tensor(entry.param)
            for adapter in entry.adapters:
                delta = sharding.full_tensor(entry.lora_layer.get_delta_weight(adapter))  # ΔW = B A · scale
                weight = weight + delta.to(weight.dtype)
            yield entry.name, weight
