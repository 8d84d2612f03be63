"""Per-sequence recurrent state beside the paged KV cache: one slot per running sequence, for every recurrent layer.

Why: hybrid models (Qwen3.5 / Qwen3-Next: three of every four layers Gated DeltaNet; Mamba / short-convolution
hybrids) keep, in their non-attention layers, a fixed-size state per sequence (a convolution window and a recurrent
matrix) instead of keys per token; the paged cache has no place for it, so the engine keeps it here (as vLLM keeps
its hybrids' state). Lifecycle (`_upstream_recurrent`): `claim` when a sequence's prefill starts, `fork` to its G
samples (the prompt's state, like the shared KV prefix), `read` the rows of each step, the model's layer advances them,
`write` them back, `free` when the sequence ends.
Invariants: a slot holds the state after exactly the tokens the engine ran for its sequence, computed with the
weights of the steps that ran them (a weight update between steps leaves it as it is, as it leaves KV); one owner per
slot. Storage: one tensor per (layer, state) with a leading slot dimension, allocated at the first write from the
tensor the layer produced (its shape, dtype, device: e.g. Gated DeltaNet's fp32 recurrent state under a bf16 model),
grown by doubling; freed slots are reused. Engine thread only: no locking.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["RecurrentStateSlots", "StateKey"]

#: One state of one layer: ("conv" or "recurrent", the layer's state index; most layers have one of each, index 0).
StateKey = tuple[str, int]


class RecurrentStateSlots:
    """The recurrent layers' per-sequence states, one slot per live sequence (engine thread only: no locking)."""

    def __init__(self, initial_capacity: int = 8) -> None:
        self._slot_of: dict[str, int] = {}
        self._free: list[int] = []
        self._next = 0  # slots [0, _next) have been handed out at least once
        self._capacity = max(1, initial_capacity)
        self._storage: dict[int, dict[StateKey, torch.Tensor]] = {}  # layer -> key -> (capacity, *state shape)

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._slot_of

    @property
    def capacity(self) -> int:
        return self._capacity

    def slot(self, request_id: str) -> int | None:
        """The slot of `request_id`, None if it holds none."""
        return self._slot_of.get(request_id)

    def claim(self, request_id: str) -> int:
        """The slot of `request_id`, a new one if it holds none. Its contents are whatever the last owner left: the
        caller starts the sequence from no state (the layer's own zero state) and writes the slot."""
        slot = self._slot_of.get(request_id)
        if slot is not None:
            return slot
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._next
            self._next += 1
            if slot >= self._capacity:
                self._grow(2 * self._capacity)
        self._slot_of[request_id] = slot
        return slot

    def fork(self, source: str, children: Sequence[str]) -> None:
        """Give each child a slot holding a copy of `source`'s states (nothing to copy while `source` holds no slot:
        then the children start from no state, as their source would)."""
        src = self._slot_of.get(source)
        if src is None or not children:
            return
        children_slots = [self.claim(child) for child in children]
        storages = [storage for states in self._storage.values() for storage in states.values()]
        if not storages:
            return
        dst = torch.tensor(children_slots, dtype=torch.int64, device=storages[0].device)  # (C,): one copy per fork
        for storage in storages:
            storage[dst.to(storage.device)] = storage[src].clone()  # (C, *shape) <- (*shape) broadcast

    def free(self, request_id: str) -> None:
        """Release the slot of `request_id` (no-op if it holds none)."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        """Release every slot (storage is kept for the next sequences)."""
        self._slot_of.clear()
        self._free = list(range(self._next))[::-1]  # lowest slots first, as a fresh store hands them out

    def read(self, layer: int, slots: torch.Tensor) -> dict[StateKey, torch.Tensor]:
        """Copies of `layer`'s states at `slots` ((R,) int64, on the storage's device as the step plan puts them:
        moved otherwise), each (R, *state shape); empty before the first write."""
        return {key: storage[slots.to(storage.device)] for key, storage in self._storage.get(layer, {}).items()}

    def view(self, layer: int, first: int, count: int) -> dict[StateKey, torch.Tensor]:
        """`layer`'s states at slots `[first, first + count)` as views of the storage (writes to them are stored);
        empty before the first write."""
        return {key: storage[first : first + count] for key, storage in self._storage.get(layer, {}).items()}

    def write(self, layer: int, slots: torch.Tensor, states: Mapping[StateKey, torch.Tensor]) -> None:
        """Store `states` ((R, *state shape) each) at `slots` ((R,) int64, on the storage's device as the step plan
        puts them: moved otherwise) of `layer`."""
        layer_storage = self._storage.setdefault(layer, {})
        for key, value in states.items():
            storage = layer_storage.get(key)
            if storage is None:
                storage = value.new_zeros((self._capacity, *value.shape[1:]))
                layer_storage[key] = storage
            elif storage.shape[1:] != value.shape[1:]:
                raise ValueError(
                    f"Layer {layer}'s {key[0]} state {key[1]} changed shape: {tuple(storage.shape[1:])} stored, "
                    f"{tuple(value.shape[1:])} written"
                )
            storage[slots.to(storage.device)] = value.to(storage.dtype)

    def nbytes(self) -> int:
        """Bytes held by the storage (every slot, live or free)."""
        return sum(t.numel() * t.element_size() for states in self._storage.values() for t in states.values())

    def _grow(self, capacity: int) -> None:
        for states in self._storage.values():
            for key, storage in states.items():
                grown = storage.new_zeros((capacity, *storage.shape[1:]))
                grown[: storage.shape[0]] = storage
                states[key] = grown
        self._capacity = capacity
