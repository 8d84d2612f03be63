"""docs/architecture.md's "How to add" lists name real places: every `` `trl_cb/...py` `Symbol` `` pair resolves to a
module attribute (dotted for a method), and every other cited repository path exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAIR = re.compile(r"`(trl_cb/[\w/]+)\.py` `([\w.]+)`")
PATH = re.compile(r"`?((?:trl_cb|tests|docs)/[\w/]+\.(?:py|md))`?|\b(docs/[\w-]+\.md)\b")


def how_to_add() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return text[text.index("## How to add") : text.index("## Every module")]


def resolve(module_path: str, symbol: str) -> object:
    obj: object = importlib.import_module(module_path.replace("/", "."))
    for part in symbol.split("."):
        obj = getattr(obj, part)
    return obj


def test_every_named_symbol_exists():
    pairs = PAIR.findall(how_to_add())
    assert len(pairs) >= 12, pairs
    missing = []
    for module_path, symbol in pairs:
        try:
            resolve(module_path, symbol)
        except (ImportError, AttributeError) as err:
            missing.append(f"{module_path}.py {symbol}: {err}")
    assert not missing, missing


def test_every_named_path_exists():
    paths = {a or b for a, b in PATH.findall(how_to_add())}
    assert {"tests/model_zoo.py", "docs/server.md"} <= paths
    assert not [p for p in paths if not (ROOT / p).exists()]


def test_a_stale_name_is_caught():
    """Control: a renamed symbol fails to resolve."""
    try:
        resolve("trl_cb/trainers/async_bridge", "AsyncRolloutsMixin.controller")
    except AttributeError:
        return
    raise AssertionError("a missing symbol resolved")
