"""Debug switches read from the environment: for A/B measurements and bisecting, not settings of a training run.
Each is read at every engine build unless said otherwise, so a test can set it for one call.

`TRL_CB_ATTENTION=upstream`: engines keep transformers' own attention choice (without flash, a dense mask over every
key of the batch) instead of `varlen_attention`, and CPU batches are sized for that choice (`sizing.py`); also read at
every model check and sizing (`TRL_CB_OPENMP_GUARD`: `openmp.py`). `TRL_CB_DIRECT_READS=0`: `varlen_attention` reads
keys through `cache.update`'s packed copy (the path before one-gather reads, `_upstream_cache.py`); read at every
layer call. `TRL_CB_SAMPLER=upstream`: transformers' `torch.multinomial` instead of `sampler.py`'s exponential race.
`TRL_CB_DECODE_FAST_PATH=0`: every decode step scheduled and prepared by transformers' per-request Python instead of
advancing the previous batch in place (`_upstream_decode.py`). `TRL_CB_MASK_SKIP=0`: engine forwards build the
attention mask `varlen_attention` does not read (`_upstream_forward.py`). `TRL_CB_FAST_FORK=0`: forked request states
copied by `deepcopy`, not field by field (`_upstream_fork.py`).
"""

from __future__ import annotations

import os

ATTENTION_ENV = "TRL_CB_ATTENTION"


def varlen_attention_enabled() -> bool:
    """False when `TRL_CB_ATTENTION=upstream` asks for transformers' own CB attention."""
    return os.environ.get(ATTENTION_ENV, "varlen").lower() != "upstream"


DIRECT_READS_ENV = "TRL_CB_DIRECT_READS"


def direct_reads_enabled() -> bool:
    """False when `TRL_CB_DIRECT_READS=0` asks for the packed-copy read path."""
    return os.environ.get(DIRECT_READS_ENV, "1") != "0"


SAMPLER_ENV = "TRL_CB_SAMPLER"


def parallel_sampler_enabled() -> bool:
    """False when `TRL_CB_SAMPLER=upstream` asks for transformers' own sampler."""
    return os.environ.get(SAMPLER_ENV, "race").lower() != "upstream"


DECODE_FAST_PATH_ENV = "TRL_CB_DECODE_FAST_PATH"


def decode_fast_path_enabled() -> bool:
    """False when `TRL_CB_DECODE_FAST_PATH=0` asks for upstream's per-request scheduling and batch preparation."""
    return _switched_on(DECODE_FAST_PATH_ENV)


MASK_SKIP_ENV = "TRL_CB_MASK_SKIP"


def mask_skip_enabled() -> bool:
    """False when `TRL_CB_MASK_SKIP=0` asks for transformers' mask construction in engine forwards."""
    return _switched_on(MASK_SKIP_ENV)


FAST_FORK_ENV = "TRL_CB_FAST_FORK"


def fast_fork_enabled() -> bool:
    """False when `TRL_CB_FAST_FORK=0` asks for transformers' `deepcopy` of forked request states."""
    return _switched_on(FAST_FORK_ENV)


def _switched_on(env: str) -> bool:
    """An on-by-default switch: off only when `env` is "0"."""
    return os.environ.get(env, "1") != "0"
