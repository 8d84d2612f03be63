"""The engine's own view of the training model: a second module object over the *same* parameter tensors.

Why: a CB forward and a training forward of one module object interfere (the engine switches the shared config's
attention implementation, needs eval mode while training needs train mode, and would run the trainer's hooks and
gradient checkpointing). A view has its own module tree, config (so its own attention implementation), train/eval
mode and no hooks, while each of its parameters aliases the training parameter's storage: no copy in the training
dtype, and an optimizer step (in place) is seen by the view at once. That is what lets the engine keep generating
during the trainer's forward and backward (docs/async.md, "Overlap").

Invariants: the view shares every parameter's storage with the training model (`check_aliased` raises once the
trainer replaced a tensor instead of updating it in place) and every buffer object; its parameters are distinct
`Parameter` objects with `requires_grad=False`, so swapping their `.data` (generation-dtype copies) never touches the
trainer's; it is in eval mode, with gradient checkpointing off and no hooks; nothing of the view is registered on
the training model. Parameters gathered per forward (ZeRO-3, FSDP) cannot be aliased: refused.
"""

from __future__ import annotations

import copy
import logging

import torch
from transformers import PreTrainedModel

from . import _upstream_view, sharding

logger = logging.getLogger(__name__)

__all__ = ["EngineView", "SHARDED_REFUSAL"]

#: Why a sharded model has no view, and where the overlap is for it.
SHARDED_REFUSAL = (
    "cb_async_overlap needs whole local parameters to alias (single process or DDP), but this model's parameters are "
    "sharded and gathered per forward (ZeRO-3 / FSDP). Overlap for sharded training runs on rollout servers, which "
    "hold their own copy of the weights: set `cb_server_urls` (`trl-cb serve`, docs/server.md)."
)


class EngineView:
    """`module`: an eval-mode copy of `model`'s module tree whose parameters alias `model`'s tensors (see the module
    docstring). Build it after the trainer has placed the model (device, wrappers): later moves are not followed."""

    def __init__(self, model: PreTrainedModel) -> None:
        if not sharding.materialised(model):
            raise ValueError(SHARDED_REFUSAL)
        devices = {p.device for p in model.parameters()}
        if len(devices) > 1:
            on = sorted(map(str, devices))
            raise ValueError(f"cb_async_overlap needs the model on one device, got parameters on {on}.")
        # deepcopy with a memo that answers every tensor: parameters become aliases, buffers are shared, a cached
        # engine is dropped; everything else (modules, config, generation config) is copied.
        memo: dict[int, object] = {}
        self._aliases: list[tuple[torch.nn.Parameter, torch.Tensor]] = []  # (training parameter, view storage)
        for param in dict.fromkeys(model.parameters()):  # tied parameters once
            storage = param.detach()
            memo[id(param)] = torch.nn.Parameter(storage, requires_grad=False)
            self._aliases.append((param, storage))
        for buffer in model.buffers():
            memo[id(buffer)] = buffer
        for sub in model.modules():
            cached = vars(sub).get(_upstream_view.CACHED_MANAGER_ATTRIBUTE)
            if cached is not None:
                memo[id(cached)] = None
        view = copy.deepcopy(model, memo)
        stripped = {name for sub in view.modules() for name in _upstream_view.strip_attachments(sub)}
        if stripped:
            logger.info("Engine view: removed the trainer's %s from the copy.", ", ".join(sorted(stripped)))
        view.eval()
        self.module: PreTrainedModel = view

    def check_aliased(self) -> None:
        """`RuntimeError` unless every training parameter still lives where the view reads it (the optimizer must
        update in place; `param.data = ...`, `model.to(...)` or a re-wrapped model break the alias)."""
        for param, storage in self._aliases:
            if param.data_ptr() != storage.data_ptr() or param.shape != storage.shape:
                raise RuntimeError(
                    "cb_async_overlap: a training parameter was replaced instead of updated in place (e.g. "
                    "`param.data = ...` or `model.to(...)` after training started), so the engine no longer reads "
                    f"the trained weights (shape {tuple(param.shape)}). Keep parameters in place, or turn "
                    "cb_async_overlap off."
                )
