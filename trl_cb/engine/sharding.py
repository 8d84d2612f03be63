"""Sharded parameters (DeepSpeed ZeRO-3, FSDP1, FSDP2): the one place that tells whether parameters are sharded and
that holds FSDP2 groups whole for a generation round.

Two different questions, both asked here: `is_sharded` (does the training setup shard parameters between rounds:
then a kept full copy of the weights would be a whole model per rank) and `materialised` (are the parameters whole on
this process right now: a model check can probe only then). torch internals used by `fsdp2_unsharded` are pinned in
tests/unit/test_contracts.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["fsdp2_unsharded", "is_sharded", "materialised", "zero_stage"]


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
