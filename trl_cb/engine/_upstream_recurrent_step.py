"""One engine step of a hybrid model's recurrent layers: the step plan, and each mixer call split by it.

`RecurrentStepper.plan_step` runs before the engine's forward: it reads the batch's requests (past and query lengths,
in the order of the packed tokens) and maps each to its state slot (`recurrent_state.RecurrentStateSlots`). In the
forward, `run` hands the packed tokens to the model's own mixer module per sequence: the rows that advance one token
from a state run as one batch (their states read from the slots, advanced by the layer's single-token path, written
back), every prefill chunk runs alone (from no state when its sequence starts, from its slot when it continues one).
The mixer gets the cache object it expects: a transformers `Cache` whose layer is a `LinearAttentionLayer` holding
those states; no layer maths is re-implemented here.
Invariant: a sequence with a past never runs from a zero state (`plan_step` raises instead).
Upstream surface (tests/unit/test_contracts.py): `FutureRequestState.query_length`, `state.position_offset` already
advanced past the step's tokens; `Cache(layers=...)`, read by a mixer at its own `layer_idx` only (`DummyLayer`s, which
hold no state, elsewhere); `LinearAttentionLayer`'s `conv_states` / `recurrent_states` / `has_previous_state` /
`is_*_initialized` / `conv_kernel_size` dicts keyed by state index; the engine's forward kwargs (`PagedAttentionArgs`),
which a mixer never gets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DummyLayer, LinearAttentionLayer
from transformers.generation.continuous_batching.input_outputs import PagedAttentionArgs

from .recurrent_state import RecurrentStateSlots, StateKey

__all__ = ["CACHE_KWARGS", "RecurrentStepper"]

#: The engine's forward kwargs: never handed on to a mixer, which runs one sequence (or one batch of rows) at a time.
_ENGINE_KWARGS = frozenset(PagedAttentionArgs.__annotations__) | {"logits_to_keep", "logits_processor_args"}
#: The cache kwarg names a mixer may take (transformers 5.24 renamed `cache_params` / `past_key_values` to `cache`).
CACHE_KWARGS = ("cache", "cache_params", "past_key_values")
#: State indices a step cache offers (Qwen3.5 / Mamba use index 0; a few experimental models use up to 2).
_STATE_INDICES = 4


@dataclass
class _Run:
    """A request whose tokens run alone through a mixer: a prefill chunk (from no state when `fresh`)."""

    slots: torch.Tensor  # (1,) int64 on the model's device: its slot, a view of the step's index tensor
    start: int  # its first token in the packed batch
    end: int
    fresh: bool


@dataclass
class _StepPlan:
    """Where each request of one forward sits in the packed tokens and which slot holds its state. Its index tensors
    are views of one tensor on the model's device, copied from the host once per step (`RecurrentStepper.plan_step`):
    every recurrent layer indexes with them as they are (on CUDA a host-to-device copy per layer would stall it)."""

    num_tokens: int
    decode_slots: torch.Tensor | None  # (R,) int64: rows advancing one token from their slot's state
    decode_tokens: torch.Tensor | None  # (R,) int64 packed positions of those rows; None when they are 0..R-1
    runs: list[_Run]
    decode_span: tuple[int, int] | None = None  # (first slot, R) when the decode slots are consecutive: no copies


class RecurrentStepper:
    """One engine's recurrent layers: the slots, the current step's plan, and a mixer call split by that plan."""

    def __init__(self, num_layers: int, device: torch.device, mixer_classes: set[type] | None = None) -> None:
        self.num_layers = num_layers
        self.device = device  # the model's: where each step's index tensors go (`plan_step`)
        #: The token-mixer classes whose `forward` the engine routes through this stepper (`routed_forward`).
        self.mixer_classes = frozenset(mixer_classes or ())
        self.slots = RecurrentStateSlots()
        self._plan: _StepPlan | None = None
        # The cache every mixer call gets: at the running layer's index the call's state layer, a `DummyLayer`
        # (no state: reading it raises) everywhere else and between calls, so no call's states outlive it. The
        # mixers read and update only `cache.layers[self.layer_idx]` (tests/unit/test_contracts.py).
        self._no_state = DummyLayer()
        self._cache = Cache(layers=[self._no_state] * num_layers)

    # ------------------------------------------------------------------------------------- bookkeeping, per step

    def plan_step(self, requests: Sequence[Any]) -> None:
        """Map the step's requests (`FutureRequestState`s in packed order, `position_offset` already advanced past
        this step's tokens) to slots. A request at position 0 claims a slot and starts from no state; one that goes
        on must hold a slot (`RuntimeError` otherwise: never a zero state for a sequence with a past). The plan's
        indices reach the model's device in one copy (decode slots, then each run's slot, then the decode rows'
        token positions where they are out of order), sliced per use."""
        decode_slots: list[int] = []
        decode_tokens: list[int] = []
        runs: list[tuple[int, int, int, bool]] = []  # (slot, start, end, fresh)
        start = 0
        for future in requests:
            state, length = future.state, future.query_length
            past = state.position_offset - length
            if past == 0:
                runs.append((self.slots.claim(state.request_id), start, start + length, True))
            else:
                slot = self.slots.slot(state.request_id)
                if slot is None:
                    raise RuntimeError(
                        f"Request {state.request_id} resumes at position {past} but holds no recurrent state: its "
                        "state was lost (a prefix-cache hit or a CPU offload, which a hybrid model's engine refuses)"
                    )
                if length == 1:
                    decode_slots.append(slot)
                    decode_tokens.append(start)
                else:
                    runs.append((slot, start, start + length, False))
            start += length
        rows, in_order = len(decode_slots), decode_tokens == list(range(len(decode_tokens)))
        consecutive = bool(decode_slots) and decode_slots == list(range(decode_slots[0], decode_slots[-1] + 1))
        host = decode_slots + [run[0] for run in runs] + ([] if in_order else decode_tokens)
        index = torch.tensor(host, dtype=torch.int64, device=self.device)  # (R + runs [+ R],): the step's one copy
        self._plan = _StepPlan(
            num_tokens=start,
            decode_slots=index[:rows] if rows else None,
            decode_tokens=None if in_order else index[rows + len(runs) :],
            runs=[_Run(index[rows + i : rows + i + 1], *run[1:]) for i, run in enumerate(runs)],
            decode_span=(decode_slots[0], rows) if consecutive else None,
        )

    def end_step(self) -> None:
        self._plan = None

    # ---------------------------------------------------------------------------------------- one mixer call

    def run(self, module: torch.nn.Module, forward: Callable[..., torch.Tensor], args: tuple, kwargs: dict) -> Any:
        """`module`'s output for the packed batch: its original `forward` run per the step's plan."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("A recurrent layer ran in an engine forward without a step plan")
        hidden = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]  # (1, T, H)
        if len(args) > 1 or (args and "hidden_states" in kwargs):
            raise TypeError(f"{type(module).__name__}: only hidden_states may be passed positionally")
        if hidden.shape[0] != 1 or hidden.shape[1] != plan.num_tokens:
            raise RuntimeError(f"Packed hidden states {tuple(hidden.shape)} do not match the plan's tokens")
        call_kwargs = {k: v for k, v in kwargs.items() if k not in _ENGINE_KWARGS and k not in CACHE_KWARGS}
        if "attention_mask" in call_kwargs:
            call_kwargs["attention_mask"] = None  # packed, unpadded sequences: nothing to mask out of the state
        layer = module.layer_idx
        out: torch.Tensor | None = None
        if plan.decode_slots is not None:
            slots, tokens = plan.decode_slots, plan.decode_tokens
            rows = hidden[0, : len(slots)] if tokens is None else hidden[0, tokens.to(hidden.device)]  # (R, H)
            result = self._call(module, forward, rows[:, None], layer, slots, call_kwargs, False, plan.decode_span)
            if tokens is None and not plan.runs:
                return result.reshape(1, len(slots), -1)
            out = result.new_empty((1, plan.num_tokens, result.shape[-1]))
            if tokens is None:
                out[0, : len(slots)] = result[:, 0]
            else:
                out[0, tokens.to(out.device)] = result[:, 0]
        for run in plan.runs:
            chunk = hidden[:, run.start : run.end]  # (1, L, H)
            result = self._call(module, forward, chunk, layer, run.slots, call_kwargs, run.fresh)
            if out is None:
                out = result.new_empty((1, plan.num_tokens, result.shape[-1]))
            out[:, run.start : run.end] = result
        return out

    def _call(
        self,
        module: torch.nn.Module,
        forward: Callable[..., torch.Tensor],
        hidden: torch.Tensor,  # (B, L, H)
        layer: int,
        slots: torch.Tensor,  # (B,) int64
        kwargs: dict,
        fresh: bool,
        span: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """One call of the model's own mixer on `hidden`, its states read from and written back to `slots`. With
        `span` (the slots are consecutive) the layer gets views of the storage and updates them in place, as it does
        its own cache's (steady decode: no copies); a state it replaced instead of updating is written back."""
        state_layer = LinearAttentionLayer(number_of_states=_STATE_INDICES)
        states: dict[StateKey, torch.Tensor] = {}
        if not fresh:
            states = self.slots.view(layer, *span) if span is not None else self.slots.read(layer, slots)
            if not states:
                raise RuntimeError(f"Layer {layer} has no stored state for rows that go on from one")
            _load(state_layer, states)
        self._cache.layers[layer] = state_layer
        try:
            result = forward(module, hidden, cache=self._cache, **kwargs)
        finally:
            self._cache.layers[layer] = self._no_state
        stored = _stored(state_layer)
        views = states if span is not None else {}  # updated in place: already in the storage
        written = {key: value for key, value in stored.items() if value is not views.get(key)}
        if written:
            self.slots.write(layer, slots, written)
        return result


def _load(layer: LinearAttentionLayer, states: dict[StateKey, torch.Tensor]) -> None:
    """Put `states` (read from the slots) in `layer` as a cache that has seen the sequence's past."""
    for (kind, index), value in states.items():
        if kind == "conv":
            layer.conv_states[index] = value
            layer.is_conv_states_initialized[index] = True
            layer.conv_kernel_size[index] = value.shape[-1]
        else:
            layer.recurrent_states[index] = value
            layer.is_recurrent_states_initialized[index] = True
        layer.has_previous_state[index] = True
        layer.dtype, layer.device = value.dtype, value.device


def _stored(layer: LinearAttentionLayer) -> dict[StateKey, torch.Tensor]:
    """The states `layer` holds after a mixer call: what the slots keep."""
    states: dict[StateKey, torch.Tensor] = {}
    for index in range(layer.number_of_states):
        if layer.is_conv_states_initialized[index]:
            states[("conv", index)] = layer.conv_states[index]
        if layer.is_recurrent_states_initialized[index]:
            states[("recurrent", index)] = layer.recurrent_states[index]
    return states
