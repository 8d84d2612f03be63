"""One helper for every deprecation warning, so all of them name the replacement and removal version alike and
point at the user's line (TRL's neighbouring shims use different `stacklevel`s; we keep one)."""

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
