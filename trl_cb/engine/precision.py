"""Generation precision: run a round in bf16/fp16 on *copies* of the weights; the training module is never cast.

Why: TRL's CB path casts the model in place and never back, so with TRL's defaults (`bf16=True`, an fp32 model) the
first round turns the fp32 master weights into bf16 for the rest of training. Here each floating-point parameter's
`.data` points at a low-precision copy for the round and at its own tensor again afterwards. Buffers keep their dtype,
as under the trainer's `torch.autocast` (a bf16-rounded rotary `inv_freq` moves logprobs by ~1 nat at 1500 tokens).

Invariants: after `applied()` exits (also by an exception) every parameter holds the very tensor it held before, and
the module's attributes (tied weights included) are the objects they were; gradients and optimizer state are never
touched. Inside, parameters are in `dtype` (the LM head in fp32 with `lm_head_fp32`, tied embeddings untied for the
round), buffers in their own dtype, and `module.dtype` (which sizes the KV cache) is the generation dtype. Kept
copies (`keep_copies`) are refreshed in place with `copy_`: stable addresses, no allocation per round, one copy held
(2 bytes per fp32 parameter for bf16); per-round copies are freed after each round. Costs: docs/distributed.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class GenerationPrecision:
    """Swap a module's floating-point tensors to `dtype` copies for the duration of `applied()`.

    Args:
        dtype: The generation dtype (`None`: keep each tensor's own dtype; only `lm_head_fp32` applies).
        lm_head_fp32: Keep (or make) the output embedding fp32 and feed it fp32 hidden states (TRL's
            `cast_lm_head_to_fp32`).
        keep_copies: Keep the copies between rounds (stable addresses, no per-round allocation); see module docstring.
    """

    def __init__(self, dtype: torch.dtype | None, lm_head_fp32: bool = False, keep_copies: bool = True) -> None:
        self.dtype = dtype
        self.lm_head_fp32 = lm_head_fp32
        self.keep_copies = keep_copies
        # id(holder) -> (holder, copy); the holder (a tensor, or the embedding it is untied for) is kept so that its
        # id cannot be reused by another object.
        self._copies: dict[int, tuple[object, torch.Tensor]] = {}

    @property
    def copy_bytes(self) -> int:
        """Bytes held by copies kept between rounds."""
        return sum(c.numel() * c.element_size() for _, c in self._copies.values())

    def release(self) -> None:
        """Free the kept copies (the next round allocates new ones)."""
        self._copies.clear()

    @contextlib.contextmanager
    def applied(self, module: torch.nn.Module) -> Iterator[None]:
        """Point the module's tensors at generation-dtype copies; restore the originals on exit."""
        head = _output_embeddings(module) if self.lm_head_fp32 else None
        head_ids = {id(p) for p in head.parameters()} if head is not None else set()
        dtype = self.dtype
        if dtype is None and head is not None:
            dtype = _body_dtype(module, head_ids)
        swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
        restore_attrs: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
        hooks: list[torch.utils.hooks.RemovableHandle] = []
        try:
            with torch.no_grad():
                for tensor in module.parameters():  # buffers keep their dtype (module docstring)
                    target = torch.float32 if id(tensor) in head_ids else dtype
                    if target is None or not tensor.is_floating_point() or tensor.dtype == target:
                        continue
                    original = tensor.data
                    tensor.data = self._copy_of(tensor, original, target)
                    swapped.append((tensor, original))
                if head is not None:
                    self._untie_input_embeddings(module, head, dtype, restore_attrs, hooks)
                    # Hidden states arrive in the generation dtype; the fp32 head needs fp32 input (TRL's patched
                    # head casts by itself; a plain nn.Linear does not).
                    hooks.append(head.register_forward_pre_hook(_cast_inputs_to_fp32))
            yield
        finally:
            for handle in hooks:
                handle.remove()
            for owner, name, param in restore_attrs:
                setattr(owner, name, param)
            for tensor, original in swapped:
                tensor.data = original
            if not self.keep_copies:
                self.release()

    # ------------------------------------------------------------------------------------------------ internals

    def _copy_of(self, holder: object, original: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        entry = self._copies.get(id(holder))
        if entry is not None and entry[0] is holder:
            copy = entry[1]
            if copy.shape == original.shape and copy.device == original.device and copy.dtype == dtype:
                copy.copy_(original)  # fresh values, same address
                return copy
        copy = original.to(dtype=dtype, copy=True)
        if self.keep_copies:
            self._copies[id(holder)] = (holder, copy)
        return copy

    def _untie_input_embeddings(
        self,
        module: torch.nn.Module,
        head: torch.nn.Module,
        dtype: torch.dtype | None,
        restore_attrs: list[tuple[torch.nn.Module, str, torch.nn.Parameter]],
        hooks: list[torch.utils.hooks.RemovableHandle],
    ) -> None:
        """Give a tied input embedding its own generation-dtype weight for the round (see module docstring)."""
        get_input = getattr(module, "get_input_embeddings", None)
        embed = get_input() if callable(get_input) else None
        weight = getattr(embed, "weight", None)
        if embed is None or dtype is None or weight is None or weight is not getattr(head, "weight", None):
            return
        if weight.dtype == dtype:
            return
        restore_attrs.append((embed, "weight", weight))
        embed.weight = torch.nn.Parameter(self._copy_of(embed, weight.data, dtype), requires_grad=False)

        def cast_output(_module: torch.nn.Module, _args: object, output: torch.Tensor) -> torch.Tensor:
            return output.to(dtype)

        hooks.append(embed.register_forward_hook(cast_output))


def _output_embeddings(module: torch.nn.Module) -> torch.nn.Module | None:
    get_output = getattr(module, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    return head if head is not None else getattr(module, "lm_head", None)


def _body_dtype(module: torch.nn.Module, head_ids: set[int]) -> torch.dtype | None:
    """The dtype of the first floating-point parameter outside the LM head (the model's own dtype)."""
    for param in module.parameters():
        if id(param) not in head_ids and param.is_floating_point():
            return param.dtype
    return None


def _cast_inputs_to_fp32(_module: torch.nn.Module, args: tuple[object, ...]) -> tuple[object, ...]:
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
