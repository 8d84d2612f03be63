"""`RolloutState`'s documented writers are its only writers: every assignment to one of its fields (or a field of a
dataclass it holds) in `trl_cb/trainers/` is made by the module, or the method, `WRITERS` names (read from the
source with ast, as tests/unit/test_architecture.py reads imports)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import trl_cb.trainers
from trl_cb.trainers.rollout_state import (
    WRITERS,
    AsyncRolloutState,
    DeferredCorrection,
    ImportanceSamplingState,
    RemoteRolloutState,
    RolloutState,
)

TRAINERS = Path(trl_cb.trainers.__file__).parent
#: Each field name (of `RolloutState` and the dataclasses it holds) to the part of `RolloutState` it belongs to.
PART_OF = {f.name: f.name for f in dataclasses.fields(RolloutState)} | {
    f.name: part
    for part, cls in (
        ("async_rollouts", AsyncRolloutState),
        ("remote", RemoteRolloutState),
        ("importance_sampling", ImportanceSamplingState),
        ("importance_sampling", DeferredCorrection),
    )
    for f in dataclasses.fields(cls)
}


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    else:
        return []
    flat = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found += target.elts
        else:
            flat.append(target)
    return flat


def _written_field(target: ast.expr) -> str | None:
    """The state field an assignment target writes: `x.state.f = `, `state.f = `, `state.f[k] = `."""
    if isinstance(target, ast.Subscript):
        target = target.value
    if not isinstance(target, ast.Attribute) or target.attr not in PART_OF:
        return None
    return target.attr if "state" in ast.unparse(target.value) else None


def writes(source: str) -> list[tuple[str, str, int]]:
    """(field, enclosing function, line) for every write of a state field in `source`."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            for target in _targets(child):
                field = _written_field(target)
                if field is not None:
                    found.append((field, name, child.lineno))
            visit(child, name)

    visit(ast.parse(source), "<module>")
    return found


def offenders() -> list[str]:
    wrong = []
    for path in sorted(TRAINERS.glob("*.py")):
        for field, function, line in writes(path.read_text()):
            owner = WRITERS[PART_OF[field]]
            module, _, method = owner.partition(".")
            if path.stem != module or (method and function != method):
                wrong.append(f"{path.name}:{line} {function} writes {field} (owner: {owner})")
    return wrong


def test_every_part_of_the_state_names_its_writer():
    assert set(WRITERS) == {f.name for f in dataclasses.fields(RolloutState)}


def test_only_the_documented_writers_write_the_state():
    assert not offenders(), offenders()


def test_the_check_sees_a_second_writer():
    """What issue 50 removed: `_cb_score` (mixin.py) clearing the async step's groups and the round's logprobs."""
    source = (
        "def _cb_score(self):\n"
        "    state = self.rollout_state\n"
        "    state.async_rollouts.step_groups = None\n"
        "    sampled, state.sampling_logprobs = state.sampling_logprobs, None\n"
    )
    assert writes(source) == [("step_groups", "_cb_score", 3), ("sampling_logprobs", "_cb_score", 4)]
    assert WRITERS[PART_OF["step_groups"]] == "async_bridge" and WRITERS["sampling_logprobs"] == "mixin._cb_generate"
