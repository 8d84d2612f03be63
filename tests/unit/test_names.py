"""One name per concept inside trl_cb (docs/architecture.md, "One name per concept"): the completion-token limit is
`max_new_tokens` (`GenerationConfig`'s) per request or turn and `max_completion_length` (TRL's) for a whole
multi-turn sample; the wire's `max_tokens` / `max_completion_tokens` exist only as request-body fields, converted once
by the body's `max_new_tokens()`. "engine" is a built CB engine (`rollouts/pool.py` `Engine`) only: the server's
`EngineLoop` and a hybrid's `RecurrentStepper` are never held under that name. The scans walk every module and have
controls."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "trl_cb"
WIRE_ONLY = {"max_tokens", "max_completion_tokens"}  # request-body fields, nowhere else
RETIRED = {"new_tokens", "max_completion", "max_generated"}  # internal names the limit used to have


def offences(source: str, where: str, banned: set[str] = WIRE_ONLY | RETIRED) -> list[str]:
    """Each parameter, function, variable or attribute in `source` named one of `banned`, except a request body's
    field (an annotated name in a class body)."""
    tree = ast.parse(source)
    fields = {
        id(node)
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef)
        for node in cls.body
        if isinstance(node, ast.AnnAssign)
    }
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [node.name] + [a.arg for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs]
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and id(node) not in fields:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    names += (
                        [sub.id] if isinstance(sub, ast.Name) else [sub.attr] if isinstance(sub, ast.Attribute) else []
                    )
        found += [f"{where}:{node.lineno} {name}" for name in names if name in banned]
    return found


def test_the_completion_token_limit_has_one_internal_name():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += offences(path.read_text(), str(path.relative_to(PACKAGE)))
    assert not found, found


def test_a_second_name_is_caught():
    """Control: a parameter, a variable and an attribute under a wire name are flagged; a body's field is not."""
    source = (
        "class Body:\n    max_tokens: int = 1\n"  # line 2: a body's field, allowed
        "def submit(prompts, max_tokens):\n    limit = max_tokens\n"  # line 3: a parameter
        "def new_tokens(self):\n    self.max_completion = 3\n"  # lines 5, 6: a function, an attribute
        "max_tokens = 2\n"  # line 7: a variable
    )
    assert sorted(offences(source, "x")) == [
        "x:3 max_tokens",
        "x:5 new_tokens",
        "x:6 max_completion",
        "x:7 max_tokens",
    ]


def test_the_server_holds_no_engine_by_that_name():
    """`serving/` holds the `EngineLoop` (which steps the engine), never an engine under the name `engine`; neither
    does the hybrid stepper's module."""
    paths = sorted((PACKAGE / "serving").glob("*.py")) + [PACKAGE / "engine" / "_upstream_recurrent.py"]
    found = [hit for path in paths for hit in offences(path.read_text(), path.name, {"engine"})]
    assert not found, found


def test_an_engine_name_is_caught():
    """Control: the server's old spelling (a parameter, an app attribute) is flagged."""
    source = "def weight_router(engine, weights):\n    app.state.engine = engine\n"
    assert offences(source, "x", {"engine"}) == ["x:1 engine", "x:2 engine"]
