"""Deprecations, one way: `warn_deprecated` for every warning (same wording, removal version and `stacklevel`, pointing
at the user's line; TRL's neighbouring shims differ there).

Only names that were released get a shim. trl_cb's own names before its first release (0.1.0) were renamed outright;
TRL's `use_transformers_paged` keeps working, forwarded with a warning, as TRL deprecates it.
"""

from __future__ import annotations

import warnings

#: trl_cb release in which deprecated parameters are removed.
REMOVAL_VERSION = "1.0.0"


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
