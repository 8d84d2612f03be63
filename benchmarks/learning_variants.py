"""Configurations of the async backends that one learning run compares: each is a labelled curve.

A variant is a small set of trl_cb config overrides (prefetch depth, staleness bound, keep-stale, IS mode and clip
bounds) written as a spec string, `depth=3,max_staleness=4,keep_stale=1,is_mode=sequence_truncate,is_clip_max=2`.
The spec is also the curve's label, so a result file says exactly what each curve ran. Variants apply to the async
backends only (`trl_cb_async`, `trl_cb_server_async`); sync backends run once with the config's defaults.

Three ways to name them on `benchmarks/learning.py`'s command line, which all expand to a list of specs:
- a grid: `--prefetch-depth 0 1 2`, `--max-staleness ...`, `--keep-stale`, `--is-mode ...`, `--is-clip-min ...`,
  `--is-clip-max ...`: the cartesian product of the values given (one value each by default: one variant);
- `--staleness-sweep 2 4 8`: for each S, `depth=S-1,max_staleness=S,keep_stale=1` (the achieved staleness is at most
  `(prefetch_depth + 1) * k` with k = 1 optimizer step per take here, so S needs depth S-1), times the IS axes;
- `--variants SPEC [SPEC ...]`: the list itself.

Values are not validated here beyond their type: the trainer's config does (`GRPOConfig` / `RLOOConfig`), and the
benchmark builds each config once before any run to report a rejected combination up front (`check_variants`).
"""

from __future__ import annotations

import itertools
from typing import Any

#: Spec key -> (trl_cb config field, parser). The order is the label's order.
FIELDS: dict[str, tuple[str, Any]] = {
    "depth": ("cb_async_prefetch_depth", int),
    "max_staleness": ("cb_async_max_staleness", int),
    "keep_stale": ("cb_async_keep_stale", lambda v: _parse_bool(v)),
    "is_mode": ("cb_importance_sampling_mode", str),
    "is_clip_min": ("cb_importance_sampling_clip_min", float),
    "is_clip_max": ("cb_importance_sampling_clip_max", float),
    "is_normalize": ("cb_importance_sampling_normalize", lambda v: _parse_bool(v)),
}


def default_depth(overlap: bool = False) -> int:
    """The depth every variant states (the config's default), so every async label names it. Imported here, not at
    the top: `trl_cb.configs` imports TRL's trainer config (seconds), which `learning.py --help` must not pay."""
    from trl_cb.configs import DEFAULT_OVERLAP_PREFETCH_DEPTH, DEFAULT_PREFETCH_DEPTH

    return DEFAULT_OVERLAP_PREFETCH_DEPTH if overlap else DEFAULT_PREFETCH_DEPTH


def backend_default(backend: str, settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` of the default grid (no depth asked for) at `backend`'s own default depth: overlap's config default
    is 0 (`trl_cb.configs.DEFAULT_OVERLAP_PREFETCH_DEPTH`), every other backend's `default_depth()`."""
    if backend == "trl_cb_overlap_async":
        return {**settings, "depth": default_depth(overlap=True)}
    return settings


def _parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected 0/1/true/false, got {value!r}")


def none_or(parse: Any, value: Any) -> Any:
    """`none` (any case) stands for the config's `None` (e.g. no lower IS bound)."""
    return None if isinstance(value, str) and value.strip().lower() == "none" else parse(value)


def parse_spec(spec: str) -> dict[str, Any]:
    """`"depth=3,keep_stale=1"` -> `{"depth": 3, "keep_stale": True}`; `ValueError` naming the bad part."""
    settings: dict[str, Any] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in FIELDS:
            raise ValueError(f"variant {spec!r}: {part!r} is not KEY=VALUE with KEY one of {list(FIELDS)}")
        if key in settings:
            raise ValueError(f"variant {spec!r}: {key} given twice")
        try:
            settings[key] = none_or(FIELDS[key][1], value.strip())
        except ValueError as err:
            raise ValueError(f"variant {spec!r}: {key}: {err}") from None
    settings.setdefault("depth", default_depth())
    return settings


def label(settings: dict[str, Any]) -> str:
    """The canonical spec string of `settings` (keys in `FIELDS` order): the curve's label, parseable back."""

    return ",".join(f"{k}={_text(settings[k])}" for k in FIELDS if k in settings)


def _text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(int(value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def config_overrides(settings: dict[str, Any]) -> dict[str, Any]:
    """The trl_cb config fields a variant sets (the rest keep the config's defaults)."""
    return {FIELDS[k][0]: v for k, v in settings.items()}


def grid(
    depths: list[int] | None,
    staleness: list[int | None] | None,
    keep_stale: bool,
    is_modes: list[str | None] | None,
    clip_mins: list[float | None] | None,
    clip_maxs: list[float | None] | None,
    staleness_sweep: list[int] | None = None,
) -> list[dict[str, Any]]:
    """The variants of the grid flags (see the module docstring); an axis left `None` is not set."""
    if staleness_sweep:
        pairs: list[tuple[int, int | None, bool]] = [(s - 1, s, True) for s in staleness_sweep]
    else:
        pairs = [(d, s, keep_stale) for d in (depths or [default_depth()]) for s in (staleness or [None])]
    out = []
    for (depth, bound, keep), mode, lo, hi in itertools.product(
        pairs, is_modes or [None], clip_mins or ["unset"], clip_maxs or ["unset"]
    ):
        settings: dict[str, Any] = {"depth": depth}
        if bound is not None:
            settings["max_staleness"] = bound
        if keep:
            settings["keep_stale"] = True
        if mode is not None:
            settings["is_mode"] = mode
        if lo != "unset":
            settings["is_clip_min"] = lo
        if hi != "unset":
            settings["is_clip_max"] = hi
        out.append(settings)
    return dedupe(out)


def dedupe(variants: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: dict[str, dict[str, Any]] = {}
    for v in variants:
        seen.setdefault(label(v), v)
    return list(seen.values())


def check_variants(trainers: list[str], variants: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """Build each (trainer, variant)'s async config once: `{(trainer, label): the config's error}` for the rejected
    ones (e.g. a `geometric_*` IS mode for GRPO's VESPO loss, which needs token-level weights). Nothing runs."""
    import tempfile
    import warnings

    import trl_cb

    rejected = {}
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind, settings in itertools.product(trainers, variants):
            config_cls = trl_cb.GRPOConfig if kind == "grpo" else trl_cb.RLOOConfig
            try:
                config_cls(
                    output_dir=out, use_cpu=True, report_to=[], use_transformers_continuous_batching=True,
                    cb_async_generation=True, **config_overrides(settings),
                )  # fmt: skip
            except (ValueError, TypeError) as err:
                rejected[kind, label(settings)] = str(err)
    return rejected
