"""Sharded parameters (DeepSpeed ZeRO-3, FSDP1, FSDP2): the one place that tells whether parameters are sharded, that
holds FSDP2 groups whole for a generation round, and that makes one parameter at a time whole (`gathered`,
`full_tensor`, `iter_full_parameters`: weight pushes to rollout servers).

Two different questions, both asked here: `is_sharded` (does the training setup shard parameters between rounds:
then a kept full copy of the weights would be a whole model per rank) and `materialised` (are the parameters whole on
this process right now: a model check can probe only then). torch internals used by `fsdp2_unsharded` are pinned in
tests/unit/test_contracts.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = [
    "fsdp2_unsharded",
    "full_shape",
    "full_tensor",
    "gathered",
    "is_sharded",
    "iter_full_parameters",
    "materialised",
    "zero_stage",
]


def zero_stage(accelerator: Accelerator | None) -> int | None:
    """The DeepSpeed ZeRO stage of `accelerator` (`None` without DeepSpeed)."""
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    return None if plugin is None else getattr(plugin, "zero_stage", None)


def is_sharded(model: torch.nn.Module, accelerator: Accelerator | None) -> bool:
    """Whether parameters are sharded between rounds: ZeRO-3, FSDP through `accelerator`, or FSDP2 modules."""
    if accelerator is not None:
        from accelerate.utils import DistributedType

        if zero_stage(accelerator) == 3 or getattr(accelerator, "distributed_type", None) == DistributedType.FSDP:
            return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def materialised(model: torch.nn.Module) -> bool:
    """True when every parameter is a whole, local tensor (no ZeRO-3 partition, FSDP shard or meta tensor)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        DTensor = ()  # noqa: N806
    for p in model.parameters():
        if p.device.type == "meta" or hasattr(p, "ds_id") or isinstance(p, DTensor):
            return False
        if type(p).__name__ == "FlatParameter":
            return False
    return True


@contextmanager
def fsdp2_unsharded(module: torch.nn.Module) -> Iterator[None]:
    """Hold every FSDP2 (`fully_shard`) parameter group of `module` unsharded for a whole generation round.

    Why: TRL's `summon_full_params` is a no-op for FSDP2, whose hooks all-gather before each forward and reshard
    after it. The CB engine runs forwards on its own thread, a data-dependent number of times per rank, so per-forward
    collectives would pair up across ranks out of step (seen: gloo "connection closed", wrong results). We unshard
    once (collectively, all ranks together), turn reshard-after-forward off so the engine's forwards run no
    collective, and on exit reshard and restore each group's exact reshard setting (torch internals
    `_auto_reshard_after_forward` and `post_forward_mesh_info`, pinned by tests/unit/test_contracts.py).
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        yield
        return
    fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not fsdp_modules:
        yield
        return
    saved = []
    for m in fsdp_modules:
        state = m._get_fsdp_state()
        saved.append(
            (state, state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in state._fsdp_param_groups])
        )
        m.set_reshard_after_forward(False, recurse=False)
    try:
        for m in fsdp_modules:
            m.unshard()
        yield
    finally:
        for m in fsdp_modules:
            m.reshard()
        for state, auto, infos in saved:
            state._auto_reshard_after_forward = auto
            for group, info in zip(state._fsdp_param_groups, infos):
                group.post_forward_mesh_info = info


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The whole parameter's shape, known on every rank without a collective (ZeRO-3 keeps it in `ds_shape`, a
    partitioned parameter's own shape is empty; a DTensor's `shape` is already the global one)."""
    return tuple(param.ds_shape) if hasattr(param, "ds_id") else tuple(param.shape)


def _refuse_flat(params: Sequence[torch.Tensor]) -> None:
    if any(type(p).__name__ == "FlatParameter" for p in params):
        raise NotImplementedError(
            "FSDP1 flat parameters cannot be gathered one at a time under their own names; use FSDP2 "
            "(fsdp_version: 2) or DeepSpeed ZeRO-3."
        )


@contextmanager
def gathered(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Hold the ZeRO-3 partitioned ones of `params` whole on this rank inside the block (read-only: DeepSpeed's
    `GatheredParameters` without a modifier rank discards changes). Nothing to do for local or DTensor parameters.

    A collective: every rank enters it with the same parameters in the same order. Memory: `params` whole, nothing
    more, so callers pass one parameter (or one LoRA layer) at a time, never the whole model."""
    _refuse_flat(params)
    zero = [p for p in params if hasattr(p, "ds_id")]
    if not zero:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(zero):
        yield


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """`param` whole and detached: a DTensor (FSDP2) is all-gathered (a collective: every rank calls it, in the same
    order); a ZeRO-3 parameter must be inside `gathered([param])`; a local one is returned as it is (no copy)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        DTensor = ()  # noqa: N806
    if isinstance(param, DTensor):
        return param.full_tensor().detach()
    if hasattr(param, "ds_id") and tuple(param.shape) != full_shape(param):
        raise RuntimeError("a ZeRO-3 parameter is read outside `gathered([param])`: it is still partitioned")
    return param.detach()


def iter_full_parameters(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, whole tensor)` for each of `named`, one at a time, on every rank (all ranks must iterate to the end).

    Invariant: at most one parameter is gathered at any moment; a yielded tensor is valid until the next one is
    requested (under ZeRO-3 the gathered storage is released when the iteration moves on), so consumers copy or send
    it before asking for the next."""
    for name, param in named:
        with gathered([param]):
            yield name, full_tensor(param)
