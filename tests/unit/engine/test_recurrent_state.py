"""The per-sequence state slots of hybrid models' recurrent layers (trl_cb/engine/recurrent_state.py)."""

from __future__ import annotations

import pytest
import torch

from trl_cb.engine.recurrent_state import RecurrentStateSlots

CONV, REC = ("conv", 0), ("recurrent", 0)


def states(value: float, rows: int = 1) -> dict:
    """A conv state (rows, 6, 4) in fp32 and a recurrent state (rows, 2, 3, 3) in fp64 (layers keep their own)."""
    return {
        CONV: torch.full((rows, 6, 4), value, dtype=torch.float32),
        REC: torch.full((rows, 2, 3, 3), value, dtype=torch.float64),
    }


def test_claim_write_read_free_reuse():
    slots = RecurrentStateSlots(initial_capacity=2)
    a, b = slots.claim("a"), slots.claim("b")
    assert (a, b) == (0, 1) and slots.claim("a") == a and len(slots) == 2 and "a" in slots
    assert slots.read(3, torch.tensor([a])) == {}, "nothing stored before the first write"
    slots.write(3, torch.tensor([a, b]), {CONV: torch.stack([states(1.0)[CONV][0], states(2.0)[CONV][0]]),
                                         REC: torch.stack([states(1.0)[REC][0], states(2.0)[REC][0]])})  # fmt: skip
    read = slots.read(3, torch.tensor([b, a]))
    assert read[CONV].dtype == torch.float32 and read[REC].dtype == torch.float64, "each state keeps its dtype"
    assert read[CONV][:, 0, 0].tolist() == [2.0, 1.0] and read[REC][:, 0, 0, 0].tolist() == [2.0, 1.0]
    read[CONV].zero_()
    assert slots.read(3, torch.tensor([b]))[CONV].max() == 2.0, "reads are copies: a layer's in-place update waits"
    slots.free("a")
    assert slots.slot("a") is None and slots.claim("c") == a, "a freed slot is handed out again"
    slots.free("zzz")  # unknown: no-op


def test_views_of_consecutive_slots_write_through():
    slots = RecurrentStateSlots()
    for i, name in enumerate("abc"):
        slots.write(2, torch.tensor([slots.claim(name)]), states(float(i)))
    view = slots.view(2, 1, 2)  # slots of b and c
    assert view[CONV].shape == (2, 6, 4) and view[REC][:, 0, 0, 0].tolist() == [1.0, 2.0]
    view[REC].mul_(10)  # a layer updating its state in place
    assert slots.read(2, torch.tensor([0, 1, 2]))[REC][:, 0, 0, 0].tolist() == [0.0, 10.0, 20.0]
    assert slots.view(9, 0, 1) == {}


def test_growth_keeps_every_stored_state():
    slots = RecurrentStateSlots(initial_capacity=1)
    for i in range(5):
        slots.write(0, torch.tensor([slots.claim(f"r{i}")]), states(float(i)))
    assert slots.capacity >= 5
    got = slots.read(0, torch.tensor([slots.slot(f"r{i}") for i in range(5)]))
    assert got[CONV][:, 0, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert slots.nbytes() == slots.capacity * (6 * 4 * 4 + 2 * 3 * 3 * 8)


def test_fork_copies_the_source_state_to_every_child():
    slots = RecurrentStateSlots()
    src = slots.claim("p")
    slots.write(1, torch.tensor([src]), states(7.0))
    slots.fork("p", ["p__child#0", "p__child#1"])
    children = torch.tensor([slots.slot("p__child#0"), slots.slot("p__child#1")])
    assert len(set(children.tolist()) | {src}) == 3
    assert slots.read(1, children)[REC].eq(7.0).all()
    slots.write(1, children[:1], states(1.0))  # a child's state moves on alone
    assert slots.read(1, torch.tensor([src]))[REC].eq(7.0).all() and slots.read(1, children[1:])[REC].eq(7.0).all()
    slots.fork("never-ran", ["x"])  # a source without a slot: its children start from no state
    assert slots.slot("x") is None


def test_clear_releases_every_slot_and_a_changed_shape_is_an_error():
    slots = RecurrentStateSlots()
    for name in "abc":
        slots.write(0, torch.tensor([slots.claim(name)]), states(1.0))
    slots.clear()
    assert len(slots) == 0 and slots.claim("d") == 0
    with pytest.raises(ValueError, match="changed shape"):
        slots.write(0, torch.tensor([0]), {CONV: torch.zeros(1, 5, 4)})
