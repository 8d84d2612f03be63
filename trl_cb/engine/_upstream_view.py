"""The torch / transformers / accelerate module internals the engine view (`model_view.py`) relies on.

A view is a structural copy of a model whose parameters alias the training tensors. Copying a module also copies what
others attached to it (hooks, handles, instance-level `forward` wrappers, a cached CB engine); each such attachment
is named and stripped here, and tests/unit/test_contracts.py pins the names, so an upstream rename fails one cheap
test instead of letting the view run (or remove) the trainer's hooks.
"""

from __future__ import annotations

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["CACHED_MANAGER_ATTRIBUTE", "HOOK_DICTS", "INSTANCE_FORWARDS", "strip_attachments"]

#: Where `init_continuous_batching(persistent_manager=True)` / `generate_batch` cache their manager on the model
#: (a live engine thread: never copied into a view).
CACHED_MANAGER_ATTRIBUTE = "_cached_continuous_batching_manager"

#: `torch.nn.Module` dicts of hooks registered on one module (forward, pre-forward, backward; plain and with kwargs).
HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)

#: Instance attributes that replace a module's `forward`: accelerate's mixed-precision wrapper (`forward`, the
#: original kept in `_original_forward`), its dispatch hooks (`forward` as a partial, `_hf_hook`, `_old_forward`),
#: TRL's fused-logprob patch (`forward` calling the original module's bound `forward`).
INSTANCE_FORWARDS = ("forward", "_original_forward", "_old_forward", "_hf_hook")


def strip_attachments(module: torch.nn.Module) -> list[str]:
    """Remove from one copied module (not its children) every hook, hook handle, instance `forward` and gradient
    checkpointing switch; return what was removed (for the log). The class's own `forward` runs afterwards.

    Why every instance `forward`: wrappers close over the *original* module even when bound to the copy (TRL's
    fused-logprob forward calls the training module's bound `forward`; measured: the engine then ran the trainer's
    module with its config and failed). Accelerate's autocast wrapper goes too: the view samples in the generation
    dtype of its own parameters, as synchronous rounds do. Handles: a copied `RemovableHandle` still points at the
    original module's hook dict, so removing it from the copy (as `gradient_checkpointing_disable` does with PEFT's
    input-grad hook) would remove the trainer's hook."""
    removed: list[str] = []
    for name in HOOK_DICTS:
        hooks = getattr(module, name, None)
        if hooks:
            removed.append(f"{name}[{len(hooks)}]")
            hooks.clear()
    for name, value in list(vars(module).items()):
        if name in INSTANCE_FORWARDS or isinstance(value, RemovableHandle):
            removed.append(name)
            delattr(module, name)
    # transformers' `GradientCheckpointingLayer` (and older models' own layers) check `self.gradient_checkpointing`.
    if getattr(module, "gradient_checkpointing", False):
        module.gradient_checkpointing = False
        removed.append("gradient_checkpointing")
    return removed
