"""The package's shape, read from its source (ast): layers import one way, no cycle, modules and classes stay small.

docs/architecture.md draws the same layers. Every import counts, wherever it sits (module level, inside a function,
under `TYPE_CHECKING`): a function-level import cannot be used to reach up a layer or to hide a cycle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "trl_cb"

#: Bottom to top. A module imports modules of its own layer or of lower ones, never of a higher one. A layer entry is
#: a folder (every module in it) or a module; the package root (`trl_cb/__init__.py`, the public API) is the top.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "trl_cb.errors",
        "trl_cb.deprecation",
        "trl_cb.importance_sampling",
        "trl_cb.offline",
        "trl_cb.upstream_warnings",
        "trl_cb.version",
    ),
    ("trl_cb.engine",),
    ("trl_cb.checks",),
    ("trl_cb.rollouts",),
    ("trl_cb.serving",),
    ("trl_cb.configs",),
    ("trl_cb.trainers",),
    ("trl_cb.cli",),
    ("trl_cb",),
)
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400
#: Module docstrings state purpose and invariants; essays go to docs/.
MAX_DOCSTRING_LINES = 15


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    """Index in `LAYERS` of the longest entry that is `module` or a package holding it."""
    best, depth = None, -1
    for index, entries in enumerate(LAYERS):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and entry.count(".") > depth:
                best, depth = index, entry.count(".")
    assert best is not None, f"{module} is in no layer: add it to LAYERS (and to docs/architecture.md)"
    return best


def imports_of(module: str) -> list[tuple[str, int]]:
    """Every trl_cb module `module` imports, with the line: `from . import x` names submodule x when it is one."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name.split(".")[0] == "trl_cb"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "trl_cb":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in MODULES else target, node.lineno))
    return [(name, line) for name, line in found if name in MODULES or name.rpartition(".")[0] in MODULES]


def resolved(name: str) -> str:
    """A name imported from a module (`trl_cb.errors.GenerationError`) resolved to that module."""
    return name if name in MODULES else name.rpartition(".")[0]


#: (importer, imported, where) for every import of one trl_cb module by another.
EDGES = [
    (m, resolved(n), f"{MODULES[m].relative_to(PACKAGE.parent)}:{line}") for m in MODULES for n, line in imports_of(m)
]


def upward(edges: list[tuple[str, str, str]]) -> list[str]:
    return [
        f"{where} imports {dst} (layer {layer_of(dst)} > {layer_of(src)})"
        for src, dst, where in edges
        if layer_of(dst) > layer_of(src)
    ]


def cycles(edges: list[tuple[str, str, str]]) -> list[list[str]]:
    """Every import cycle, each found once (from the first module on it that the search reaches)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for src, dst, _ in edges:
        if src != dst:
            graph[src].add(dst)
    found, state = [], dict.fromkeys(graph, 0)  # 0 new, 1 on the current path, 2 done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state[n] == 1:
                found.append(path[path.index(n) :] + [n])
            elif state[n] == 0:
                visit(n, path + [n])
        state[m] = 2

    for m in graph:
        if state[m] == 0:
            visit(m, [m])
    return found


def test_every_module_is_in_a_layer():
    for m in MODULES:
        layer_of(m)


def test_imports_run_down_the_layers():
    assert not upward(EDGES), "imports that run up a layer:\n" + "\n".join(upward(EDGES))


def test_no_import_cycle():
    assert not cycles(EDGES), "import cycles: " + "; ".join(" -> ".join(c) for c in cycles(EDGES))


def test_the_checks_see_an_injected_upward_import_and_its_cycle():
    """What issue 18 removed: `_upstream` importing `checks.model` (which imports `_upstream`)."""
    injected = [*EDGES, ("trl_cb.engine._upstream", "trl_cb.checks.model", "injected")]
    assert upward(injected) == [f"injected imports trl_cb.checks.model (layer {layer_of('trl_cb.checks.model')} > 1)"]
    assert any({"trl_cb.engine._upstream", "trl_cb.checks.model"} <= set(c) for c in cycles(injected))


def test_the_configs_sit_below_the_trainers():
    """What issue 50 removed: `configs.py` importing `trainers.trl_internals` (a config loaded the trainer stack), the
    trainers' reverse edge hidden as a function-level import, and the server importing the package root for its
    version: each is an upward import now, reported as such."""
    assert layer_of("trl_cb.configs") < layer_of("trl_cb.trainers.async_bridge")
    injected = [
        *EDGES,
        ("trl_cb.configs", "trl_cb.trainers.trl_internals", "configs"),
        ("trl_cb.serving.server", "trl_cb", "server"),
    ]
    configs, trainers, serving, root = (
        layer_of(m) for m in ("trl_cb.configs", "trl_cb.trainers", "trl_cb.serving", "trl_cb")
    )
    assert upward(injected) == [
        f"configs imports trl_cb.trainers.trl_internals (layer {trainers} > {configs})",
        f"server imports trl_cb (layer {root} > {serving})",
    ]


#: Functions of `serving/` and `trainers/` that nothing in trl_cb calls, and why they stay: called by someone else.
CALLED_FROM_OUTSIDE = {
    "cb_sync_rollout_servers": "public: a TRL `rollout_func` calls it (docs/server.md, examples/agent_openai_client)",
    "on_pre_optimizer_step": "a `TrainerCallback` hook: transformers' `Trainer` calls it",
    "on_optimizer_step": "a `TrainerCallback` hook: transformers' `Trainer` calls it",
}


def uncalled(sources: dict[str, str]) -> list[str]:
    """Functions and properties (not route handlers: their decorators are calls) in `sources` whose name appears
    nowhere in the package but their own definition: dead, or kept alive by tests only."""
    package = "\n".join(path.read_text() for path in MODULES.values())
    found = []
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("__"):
                continue
            if any(isinstance(d, ast.Call) for d in node.decorator_list) or node.name in CALLED_FROM_OUTSIDE:
                continue
            if len(re.findall(rf"\b{re.escape(node.name)}\b", package)) <= 1:
                found.append(f"{name}:{node.lineno} {node.name}")
    return found


def test_serving_and_trainers_hold_no_uncalled_function():
    """What issue 50 removed: `detokenize.TokenText.token_end` (no caller) and `RemoteRolloutController.num_threads`
    (tests only). A function only tests call is tested dead code: remove it, or say in `CALLED_FROM_OUTSIDE` who
    calls it."""
    sources = {m: MODULES[m].read_text() for m in MODULES if m.startswith(("trl_cb.serving", "trl_cb.trainers"))}
    assert not uncalled(sources), uncalled(sources)
    dead = "class RemoteRolloutController:\n    @property\n    def num_threads(self) -> int:\n        return 4\n"
    assert uncalled({"injected": dead}) == ["injected:3 num_threads"]


#: Bounds on the server's assembly: `create_app` builds the engine and includes the route modules; a route handler
#: fetches what it needs and calls the module that does the work.
MAX_CREATE_APP_LINES, MAX_ROUTE_LINES = 80, 60


def route_handlers(source: str) -> list[ast.AST]:
    """Functions registered as routes in `source`: decorated with a call (`@router.post(...)`), or passed to
    `add_api_route`."""
    tree = ast.parse(source)
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    added = {
        node.args[1].id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_api_route" and len(node.args) > 1
        and isinstance(node.args[1], ast.Name)
    }  # fmt: skip
    return [
        f for name, f in functions.items() if any(isinstance(d, ast.Call) for d in f.decorator_list) or name in added
    ]


def test_the_server_checks_auth_and_the_weight_owner_once_and_assembles_route_modules():
    """What issue 50 changed: the weight routes' owner check was written three times in `create_app` (now
    `weight_routes.require_owner`; the API key: `middleware.RequestGate` only), and every route group is a module of
    its own (`info_routes`, `generation_routes`, `weight_routes`) that `create_app` (<= 80 lines) includes; no route
    handler is over 60 lines."""
    serving = [m for m in MODULES if m.startswith("trl_cb.serving.")]
    checks = sum(MODULES[m].read_text().count("token does not match the trainer") for m in serving)
    assert checks == 1, "the owner check: `weight_routes.require_owner` only"
    key_checks = [m for m in serving if 'b"authorization"' in MODULES[m].read_text()]  # the header, read once
    assert key_checks == ["trl_cb.serving.middleware"], key_checks
    tree = ast.parse(MODULES["trl_cb.serving.server"].read_text())
    (create_app,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "create_app"]
    assert create_app.end_lineno - create_app.lineno + 1 <= MAX_CREATE_APP_LINES
    routes = [d for n in ast.walk(create_app) for d in getattr(n, "decorator_list", []) if isinstance(d, ast.Call)]
    assert not routes, "create_app registers no route itself: it includes the route modules' routers"
    handlers = {m: route_handlers(MODULES[m].read_text()) for m in serving}
    assert len(handlers["trl_cb.serving.generation_routes"]) == 5  # the check sees the handlers (control)
    long = [
        f"{m}.{f.name}: {f.end_lineno - f.lineno + 1} lines"
        for m, found in handlers.items()
        for f in found
        if f.end_lineno - f.lineno + 1 > MAX_ROUTE_LINES
    ]
    assert not long, long


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_and_class_sizes(module):
    source = MODULES[module].read_text()
    lines = len(source.splitlines())
    assert lines <= MAX_MODULE_LINES, f"{module}: {lines} lines > {MAX_MODULE_LINES}; does it hold two concepts?"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1
            assert size <= MAX_CLASS_LINES, f"{module}.{node.name}: {size} lines > {MAX_CLASS_LINES}"
    doc = ast.get_docstring(ast.parse(source), clean=False) or ""
    assert len(doc.splitlines()) <= MAX_DOCSTRING_LINES, f"{module}: module docstring over {MAX_DOCSTRING_LINES} lines"


# ------------------------------------------------------------------------------------------ no shims before 0.1.0


@pytest.mark.parametrize("old", ["trl_cb.generator", "trl_cb.data", "trl_cb.compat", "trl_cb.check_model"])
def test_module_paths_of_before_the_first_release_are_gone(old):
    """Nothing was released under the old module paths: no finder serves them, `import` fails like any unknown name
    (control: a current path imports)."""
    import importlib
    import sys

    sys.modules.pop(old, None)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
    assert importlib.import_module("trl_cb.rollouts.generator")


# --------------------------------------------------------------------------------- docs/architecture.md's module list

MODULE_LIST_START = "<!-- module list: generated by `python tests/unit/test_architecture.py` -->\n"
MODULE_LIST_END = "<!-- end of module list -->"


def module_table(modules: dict[str, Path] = MODULES) -> str:
    """docs/architecture.md's list of every module: its path and the first sentence of its docstring."""
    rows = ["| module | what it is (the first sentence of its docstring) |", "|---|---|"]
    for path in modules.values():
        relative = path.relative_to(PACKAGE)
        shown = f"{relative.parent}/" if path.name == "__init__.py" else str(relative)
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        sentence = doc.split("\n\n")[0].replace("\n", " ").split(". ")[0].rstrip(".")
        if len(sentence) > 160:
            sentence = sentence[:160].rsplit(" ", 1)[0] + " …"
        rows.append(f"| `{'trl_cb/' if shown == './' else shown}` | {sentence.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def test_architecture_doc_lists_every_module():
    """Every module is in docs/architecture.md's generated list (a new module without a docstring, or a list not
    regenerated, fails here). Control: the tree with one module less does not match the list."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    listed = doc[doc.index(MODULE_LIST_START) + len(MODULE_LIST_START) : doc.index(MODULE_LIST_END)]
    assert listed == module_table(), (
        "docs/architecture.md's module list is stale: run python tests/unit/test_architecture.py"
    )
    assert all(ast.get_docstring(ast.parse(p.read_text())) for p in MODULES.values()), "a module without a docstring"
    one_less = {name: path for name, path in MODULES.items() if name != "trl_cb.errors"}
    assert module_table(one_less) != listed  # control: a module the list does not match is caught


def diagram_names(doc: str) -> dict[str, set[str]]:
    """The modules docs/architecture.md's layer diagram names per subpackage (`cli`, `serving`, ...)."""
    block = doc[doc.index("flowchart TD") : doc.index("```", doc.index("flowchart TD"))]
    named = {}
    for package, names in re.findall(r'\w+\["(\w+)/<br/>([^"]+)"\]', block):
        named[package] = {n.strip() for n in re.split(r"·|<br/>", names) if n.strip()}
    return named


def test_the_layer_diagram_names_every_module():
    """The diagram's boxes list each subpackage's modules, all of them and no removed one. Control: a diagram without
    one module fails."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()

    def missing(named: dict[str, set[str]]) -> dict[str, set[str]]:
        off = {}
        for package, names in named.items():
            actual = {p.stem for p in (PACKAGE / package).glob("*.py") if p.stem not in ("__init__", "__main__")}
            if names != actual:
                off[package] = names ^ actual
        return off

    named = diagram_names(doc)
    assert {"cli", "trainers", "rollouts", "serving", "checks", "engine"} <= named.keys()
    assert missing(named) == {}, "docs/architecture.md's layer diagram is stale"
    assert missing({**named, "serving": named["serving"] - {"engine_loop"}}) == {"serving": {"engine_loop"}}


def write_module_table() -> None:
    """Regenerate docs/architecture.md's module list in place."""
    path = PACKAGE.parent / "docs" / "architecture.md"
    doc = path.read_text()
    head, rest = doc[: doc.index(MODULE_LIST_START) + len(MODULE_LIST_START)], doc[doc.index(MODULE_LIST_END) :]
    path.write_text(head + module_table() + rest)


if __name__ == "__main__":
    write_module_table()
