"""Each part of the trainer's rollout component is the only writer of its own state: every assignment in
`trl_cb/trainers/` to a field of `TrainerRollouts`, `AsyncBridge`, `RemoteRollouts` or `ImportanceSamplingCorrection`
(and of the `DeferredCorrection`s the last one holds) is made inside that class, to `self` (or, for a deferred
correction, inside `ImportanceSamplingCorrection`); other classes' writes to their own `self` are theirs. Read from
the source with ast; `TrainerRollouts.sampling_logprobs` has one writer method, `generate`."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import trl_cb.trainers
from trl_cb.trainers.is_correction import DeferredCorrection

TRAINERS = Path(trl_cb.trainers.__file__).parent
#: The component classes: (module, class).
OWNERS = [
    ("trainer_rollouts", "TrainerRollouts"),
    ("async_bridge", "AsyncBridge"),
    ("remote", "RemoteRollouts"),
    ("is_correction", "ImportanceSamplingCorrection"),
]
#: Fields a class holds but does not own (references given at construction, never reassigned).
REFERENCES = {"trainer", "remote", "build_generator", "per_token_loss"}
#: Fields with one writer method, not just one writer class.
ONE_METHOD = {"sampling_logprobs": "generate"}


def _class(module: str, name: str) -> ast.ClassDef:
    tree = ast.parse((TRAINERS / f"{module}.py").read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


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


def fields_of(cls: ast.ClassDef) -> set[str]:
    """The state a component class sets up in its `__init__` (`self.x = ...`), less the references it is given."""
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    names = {
        t.attr
        for node in ast.walk(init)
        for t in _targets(node)
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    return names - REFERENCES


OWNED = {name: (module, cls) for module, cls in OWNERS for name in fields_of(_class(module, cls))}
DEFERRED = {f.name for f in dataclasses.fields(DeferredCorrection)}


def writes(source: str) -> list[tuple[str, str, str, str, int]]:
    """(field, written object, enclosing class, enclosing function, line) for every write of a component field."""
    found = []

    def visit(node: ast.AST, cls: str, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner_cls = child.name if isinstance(child, ast.ClassDef) else cls
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            for target in _targets(child):
                if isinstance(target, ast.Subscript):
                    target = target.value
                if isinstance(target, ast.Attribute) and (target.attr in OWNED or target.attr in DEFERRED):
                    found.append((target.attr, ast.unparse(target.value), inner_cls, name, child.lineno))
            visit(child, inner_cls, name)

    visit(ast.parse(source), "<module>", "<module>")
    return found


def offenders(source: str, module: str) -> list[str]:
    wrong = []
    for field, obj, cls, function, line in writes(source):
        if field in DEFERRED and field not in OWNED:
            if (module, cls) != ("is_correction", "ImportanceSamplingCorrection"):
                wrong.append(f"{module}.py:{line} {cls}.{function} writes a deferred correction's {field}")
            continue
        if obj == "self" and cls not in {c for _, c in OWNERS}:
            continue  # another class's own field of the same name (e.g. `ToolConversation.turns`)
        owner = OWNED[field]
        method = ONE_METHOD.get(field)
        if (module, cls) != owner or obj != "self" or (method and function not in (method, "__init__")):
            wrong.append(f"{module}.py:{line} {cls}.{function} writes {obj}.{field} (owner: {owner[1]})")
    return wrong


def test_every_component_has_state_and_the_check_reads_it():
    assert {"generator", "sampling_logprobs"} <= {f for f, (m, _) in OWNED.items() if m == "trainer_rollouts"}
    assert {"source", "step_groups", "stream_start", "longest_prompt", "turns"} <= set(OWNED)
    assert {"connected", "client", "senders", "pushed_step", "weight_version", "batches", "pending"} <= set(OWNED)


def test_only_the_owning_component_writes_its_state():
    wrong = [o for path in sorted(TRAINERS.glob("*.py")) for o in offenders(path.read_text(), path.stem)]
    assert not wrong, wrong


def test_the_check_sees_a_second_writer():
    """What issue 50 removed: the trainer's scoring clearing the async step's groups and the round's logprobs, and a
    second method writing the round's logprobs."""
    source = (
        "class ContinuousBatchingTrainerMixin:\n"
        "    def _generate_and_score_completions(self):\n"
        "        self.rollouts.async_rollouts.step_groups = None\n"
        "class TrainerRollouts:\n"
        "    def score(self):\n"
        "        sampled, self.sampling_logprobs = self.sampling_logprobs, None\n"
    )
    assert offenders(source, "mixin") == [
        "mixin.py:3 ContinuousBatchingTrainerMixin._generate_and_score_completions writes "
        "self.rollouts.async_rollouts.step_groups (owner: AsyncBridge)",
        "mixin.py:6 TrainerRollouts.score writes self.sampling_logprobs (owner: TrainerRollouts)",
    ]
    assert len(offenders(source.replace("mixin", "trainer_rollouts"), "trainer_rollouts")) == 2


def test_the_trainer_classes_only_route_trls_hooks():
    """The trainer subclasses stay readable top to bottom: at most 15 methods over TRL's trainer (54 over six
    classes before the rollout component), each a TRL hook it overrides or one of the few it adds."""
    import trl

    from trl_cb import GRPOTrainer, RLOOTrainer

    added_by_us = {"__init__", "__del__", "cb_sync_rollout_servers"}
    for ours, theirs in ((GRPOTrainer, trl.GRPOTrainer), (RLOOTrainer, trl.RLOOTrainer)):
        methods = {
            name
            for cls in ours.__mro__
            if cls.__module__.startswith("trl_cb")
            for name, value in vars(cls).items()
            if callable(value) and (not name.startswith("__") or name in added_by_us)
        }
        assert len(methods) <= 15, sorted(methods)
        assert all(hasattr(theirs, name) or name in added_by_us for name in methods), sorted(methods)
