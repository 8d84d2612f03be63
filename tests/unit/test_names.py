"""One name per concept inside trl_cb (docs/architecture.md, "One name per concept"): the completion-token limit is
`max_new_tokens` (`GenerationConfig`'s) per request or turn and `max_completion_length` (TRL's) for a whole
multi-turn sample; the wire's `max_tokens` / `max_completion_tokens` exist only as request-body fields, converted once
by the body's `max_new_tokens()`. The scan walks every module and has a control."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "trl_cb"
WIRE_ONLY = {"max_tokens", "max_completion_tokens"}  # request-body fields, nowhere else
RETIRED = {"new_tokens", "max_completion", "max_generated"}  # internal names the limit used to have


def offences(source: str, where: str) -> list[str]:
    """Each parameter, function, variable or attribute in `source` named a wire-only or retired name, except a
    request body's field (an annotated name in a class body) for the wire-only ones."""
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
        found += [f"{where}:{node.lineno} {name}" for name in names if name in WIRE_ONLY | RETIRED]
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
