"""Deprecations, one way: `warn_deprecated` for every warning (same wording, removal version and `stacklevel`, pointing
at the user's line; TRL's neighbouring shims differ there) and `MOVED_MODULES` for module paths that moved.

Moved modules are served by a finder, not by files at the old paths: `import trl_cb.generator` yields a module holding
every name of its new home(s) and warns once; `python -m trl_cb.check_model` runs the new module. The finder is
installed once per process by `trl_cb/__init__.py` and answers only for the names in `MOVED_MODULES`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

#: trl_cb release in which deprecated parameters are removed.
REMOVAL_VERSION = "1.0.0"

#: Old module path -> the module(s) its names live in now (earlier ones win a name clash). Removed in REMOVAL_VERSION.
MOVED_MODULES: dict[str, tuple[str, ...]] = {
    "trl_cb._upstream": ("trl_cb.engine._upstream", "trl_cb.engine.sharding"),
    "trl_cb.async_rollouts": (
        "trl_cb.rollouts.async_controller",
        "trl_cb.rollouts.async_core",
        "trl_cb.rollouts.async_metrics",
        "trl_cb.rollouts.rollout_groups",
        "trl_cb.rollouts.prompt_stream",
        "trl_cb.trainers.async_bridge",
    ),
    "trl_cb.attention": ("trl_cb.engine.varlen_attention",),
    "trl_cb.check_model": ("trl_cb.cli.check_model",),
    "trl_cb.compat": ("trl_cb.checks.model",),
    "trl_cb.data": ("trl_cb.offline.data",),
    "trl_cb.generation_settings": ("trl_cb.checks.generation_settings",),
    "trl_cb.generator": (
        "trl_cb.rollouts.generator",
        "trl_cb.rollouts.model_access",
        "trl_cb.checks.inputs",
        "trl_cb.checks.engine_config",
    ),
    "trl_cb.lifecycle": ("trl_cb.engine.guards",),
    "trl_cb.openmp": ("trl_cb.engine.openmp",),
    "trl_cb.precision": ("trl_cb.engine.precision",),
    "trl_cb.request_processors": ("trl_cb.engine.request_processors",),
    "trl_cb.sizing": ("trl_cb.engine.sizing",),
    "trl_cb.tiny": ("trl_cb.offline.tiny",),
}


def warn_deprecated(old: str, new: str, stacklevel: int = 4) -> None:
    """FutureWarning: `old` is deprecated in favour of `new` and goes away in trl_cb `REMOVAL_VERSION`.

    The default `stacklevel` points at the user's `XConfig(...)` call when raised from a config's `__post_init__`
    (user -> dataclass `__init__` -> `__post_init__` -> here).
    """
    warnings.warn(
        f"`{old}` is deprecated and will be removed in trl_cb {REMOVAL_VERSION}. Use `{new}` instead.",
        FutureWarning,
        stacklevel=stacklevel,
    )


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads the old paths in `MOVED_MODULES` (see the module docstring)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED_MODULES else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a fresh module, filled by `exec_module`

    def exec_module(self, module: types.ModuleType) -> None:
        new = MOVED_MODULES[module.__name__]
        # Frames: warnings.warn <- warn_deprecated <- here <- importlib's own frames (skipped by `warnings`) <- user.
        warn_deprecated(module.__name__, " / ".join(new), stacklevel=3)
        for name in reversed(new):
            target = importlib.import_module(name)
            module.__dict__.update({k: v for k, v in vars(target).items() if not k.startswith("__")})
        module.__doc__ = f"Deprecated alias of {', '.join(new)}."

    def get_code(self, fullname: str) -> types.CodeType:
        """`python -m OLD`: run the (first) new module as `__main__`."""
        warn_deprecated(fullname, MOVED_MODULES[fullname][0], stacklevel=2)
        source = f"import runpy\nrunpy.run_module({MOVED_MODULES[fullname][0]!r}, run_name='__main__', alter_sys=True)"
        return compile(source, f"<{fullname}>", "exec")


def install_moved_module_finder() -> None:
    """Serve the old paths in `MOVED_MODULES` (idempotent; process-wide, as every import is)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
