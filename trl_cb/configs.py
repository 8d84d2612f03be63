"""`GRPOConfig` and `RLOOConfig`: TRL's configs plus the continuous-batching (CB) fields, validated up front.

Why subclasses: a user switches by changing one import. The CB fields are declared here even though recent TRL
releases declare some of them too, so behaviour does not depend on which TRL is installed; this module's
`__post_init__` runs before TRL's and leaves nothing for TRL's own shim to act on twice.

Invariants after `__post_init__`:
- `transformers_continuous_batching_config` is a dict (a JSON string is parsed), holds only keys that
  `transformers.generation.ContinuousBatchingConfig` accepts, and has `max_memory_percent` in (0, 1] (0.5 if unset).
- `use_transformers_paged=True` has been turned into `use_transformers_continuous_batching=True`, with one
  FutureWarning, and reads `False` afterwards.
- The IS settings are a valid combination for the trainer (GRPO's VESPO loss needs `token_*`; every mode suits
  RLOO: token-level weights scale its logprobs' gradient, `trainers/is_correction.py`). An unset
  `cb_importance_sampling_mode` becomes the mode the loss needs; only an explicit, conflicting choice raises.
- `prefetch_depth` is an int: unset becomes 0 with `async_overlap`, 1 otherwise.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import trl

from .checks.engine_config import DEFAULT_MAX_MEMORY_PERCENT, cb_kwargs
from .deprecation import warn_deprecated
from .importance_sampling import DEFAULT_M2_THRESHOLD, IS_MODES, TOKEN_LEVEL_MODES, is_token_level, validate_mode
from .rollouts.async_core import validate_async_bounds
from .trainers.upstream_warnings import trl_config_post_init

#: `prefetch_depth` when unset. Overlap's engine keeps generating through the training step, so its staleness is one
#: step above the held engine's at the same depth: measured at 6 seeds (docs/benchmarks.md, "Overlap: prefetch
#: depth"), depth 0 gives it staleness 0.98 and sync's learning curve, depth 1 staleness 1.93 and 1.08-1.20x samples.
DEFAULT_PREFETCH_DEPTH = 1
DEFAULT_OVERLAP_PREFETCH_DEPTH = 0

#: The IS modes for `async_generation=True` when none is set, self-normalised (`cb_importance_sampling_normalize`):
#: RLOO (a sequence-level loss) one weight per sequence, the geometric mean of its token ratios, clamped; GRPO one
#: weight per token, clamped (truncated IS). Measured against the other modes on stale samples: docs/async.md,
#: "Off-policy correction: which mode for stale samples".
ASYNC_DEFAULT_IS_MODE = "geometric_truncate"
GRPO_ASYNC_DEFAULT_IS_MODE = "token_truncate"

#: Fields holding secrets: masked in `to_dict`, `str` and `repr` (`repr=False`).
_SECRET_FIELDS = ("rollout_server_api_key",)


@dataclass
class ContinuousBatchingArguments:
    """CB fields shared by `GRPOConfig` and `RLOOConfig` (a mixin: use those, not this class directly).

    Parameters:
        use_transformers_continuous_batching (`bool`, *optional*, defaults to `False`):
            Generate rollouts with trl_cb's continuous batching engine (persistent, workload-sized, logprobs
            recorded for importance sampling).
        transformers_continuous_batching_config (`dict` or `str`, *optional*):
            Keyword arguments for `transformers.generation.ContinuousBatchingConfig` (a JSON string on the CLI).
            Cache geometry left unset is sized from the workload; `max_memory_percent` defaults to 0.5 and caps it.
        cb_importance_sampling_correction (`bool`, *optional*, defaults to `True`):
            Correct the policy-gradient term for the gap between the sampler's and the trainer's logprobs.
        cb_importance_sampling_mode (`str`, *optional*):
            One of `IS_MODES` (see docs/index.md). Unset, the mode the loss needs is chosen: `sequence_mask`; with
            `async_generation` (stale samples) `token_truncate` (GRPO) or `geometric_truncate` (RLOO); `token_mask`
            for GRPO's `loss_type="vespo"` (which weights tokens itself). Only an explicit choice the loss cannot use
            raises.
        cb_importance_sampling_clip_min (`float`, *optional*):
            Lower IS bound (truncate: clamp; mask: zero below).
        cb_importance_sampling_clip_max (`float`, *optional*, defaults to `3.0`):
            Upper IS bound (truncate: clamp; mask: zero above; `*_m2`: clamp).
        cb_importance_sampling_normalize (`bool`, *optional*):
            Divide the IS weights by their batch mean (self-normalised IS: stale samples' weights average below 1 and
            would otherwise shrink the step). Unset: on with `async_generation`, off otherwise.
        cb_importance_sampling_m2_threshold (`float`, *optional*, defaults to `0.04`):
            `token_m2` / `geometric_m2`: bound on the mean squared token log-ratio of what is kept (M2PO's tau).
        cb_generation_timeout (`float`, *optional*):
            Seconds one generation round may take before it fails with `TimeoutError` (`None`: no limit).
        cb_keep_generation_weights (`bool`, *optional*):
            With `bf16`/`fp16` (or `cast_lm_head_to_fp32`), generation runs on copies of the weights in the
            generation dtype. `True`: keep them between rounds (refreshed in place; +2 bytes per fp32 parameter for
            bf16/fp16, held all the time). `False`: make them at the start of each round and free them at its end
            (the same bytes, only during the round; one allocation per round). Unset: keep, except when the
            parameters are sharded (ZeRO-3, FSDP), where a kept copy would be the full model on every rank. No effect
            when the model is already in the generation dtype. See docs/distributed.md, "Memory".
        async_generation (`bool`, *optional*, defaults to `False`):
            Keep the engine generating across steps; see docs/async.md.
        max_staleness (`int`, *optional*):
            Async: largest accepted staleness of a group, in optimizer steps. Unset: `(prefetch_depth + 1) * k`, with
            k = `steps_per_generation * num_iterations / gradient_accumulation_steps` optimizer steps between rollout
            takes, which drops no group by construction.
        prefetch_depth (`int`, *optional*):
            Async: steps of prompts submitted ahead of the current step. Unset: 0 with `async_overlap`, else 1.
        cb_openmp_guard (`bool`, *optional*):
            While the CB generator lives, make parked OpenMP workers sleep instead of spin (`trl_cb/engine/openmp.py`):
            CPU training stays fast on a loaded machine (5-9x faster steps under two busy processes), at 5-10% of a
            quiet step. Process-wide. Unset: on for a CPU model with a multi-threaded OpenMP torch, off otherwise.
        async_keep_stale (`bool`, *optional*, defaults to `False`):
            Async: keep and IS-correct groups above `max_staleness` instead of dropping them.
        async_overlap (`bool`, *optional*, defaults to `False`):
            Async, in-process: the engine generates during forward and backward on a view of the training weights and
            pauses only for optimizer steps. ZeRO-3 / FSDP refused (docs/async.md, "Overlap").
        async_overlap_engine_threads (`int`, *optional*):
            `async_overlap` on CPU: the engine's intra-op threads (the trainer keeps its own). Unset: the trainer's.
        use_transformers_paged:
            Deprecated; use `use_transformers_continuous_batching`.
    """

    use_transformers_continuous_batching: bool = field(
        default=False,
        metadata={"help": "Generate rollouts with trl_cb's continuous batching engine."},
    )
    transformers_continuous_batching_config: dict | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for `transformers.generation.ContinuousBatchingConfig` (dict or JSON string). "
            f"Unset cache geometry is sized from the workload; `max_memory_percent` defaults to "
            f"{DEFAULT_MAX_MEMORY_PERCENT}."
        },
    )
    cb_importance_sampling_correction: bool = field(
        default=True,
        metadata={"help": "Apply importance-sampling correction on the continuous batching path."},
    )
    cb_importance_sampling_mode: str | None = field(
        default=None,
        metadata={
            "help": f"Importance-sampling mode, one of {IS_MODES}. Unset: the one the loss needs ('sequence_mask'; "
            f"with async_generation '{GRPO_ASYNC_DEFAULT_IS_MODE}' (GRPO) or '{ASYNC_DEFAULT_IS_MODE}' (RLOO); "
            "'token_mask' for GRPO's loss_type='vespo').",
            "choices": list(IS_MODES),
        },
    )
    cb_importance_sampling_clip_min: float | None = field(
        default=None,
        metadata={"help": "Lower importance-sampling bound (truncate: clamp, mask: zero below)."},
    )
    cb_importance_sampling_clip_max: float | None = field(
        default=3.0,
        metadata={"help": "Upper importance-sampling bound (truncate: clamp, mask: zero above, *_m2: clamp)."},
    )
    cb_importance_sampling_normalize: bool | None = field(
        default=None,
        metadata={
            "help": "Divide the IS weights by their batch mean (self-normalised IS). Unset: on with async_generation."
        },
    )
    cb_importance_sampling_m2_threshold: float = field(
        default=DEFAULT_M2_THRESHOLD,
        metadata={
            "help": "token_m2 / geometric_m2: largest mean squared token log-ratio of the tokens kept (M2PO's tau)."
        },
    )
    cb_generation_timeout: float | None = field(
        default=None,
        metadata={"help": "Seconds a continuous batching round may take before it fails (None: no limit)."},
    )
    cb_keep_generation_weights: bool | None = field(
        default=None,
        metadata={
            "help": "bf16/fp16 generation runs on copies of the weights in the generation dtype. True: keep them "
            "between rounds (+2 bytes per fp32 parameter, all the time); False: make and free them every round "
            "(the same bytes, during rounds only). Unset: keep unless parameters are sharded (ZeRO-3, FSDP)."
        },
    )

    cb_openmp_guard: bool | None = field(
        default=None,
        metadata={
            "help": "Make parked OpenMP workers sleep instead of spin while the CB generator lives (faster CPU "
            "training on a loaded machine, 5-10% slower on an idle one; process-wide). Unset: on for CPU models "
            "with a multi-threaded OpenMP torch, off otherwise."
        },
    )
    async_generation: bool = field(
        default=False,
        metadata={
            "help": "Keep the CB engine generating across training steps (bounded staleness, partial rollouts, IS "
            "with behaviour logprobs). Single process or DDP; see docs/async.md."
        },
    )
    max_staleness: int | None = field(
        default=None,
        metadata={
            "help": "Async: largest accepted age of a group's oldest token, in optimizer steps. Unset: "
            "(prefetch_depth + 1) * k, with k = steps_per_generation * num_iterations / gradient_accumulation_steps "
            "optimizer steps between rollout takes; a group waits at most that long, so nothing is dropped."
        },
    )
    prefetch_depth: int | None = field(
        default=None, metadata={"help": "Async: steps of prompts sent ahead (unset: 0 with async_overlap, else 1)."}
    )
    async_keep_stale: bool = field(
        default=False,
        metadata={"help": "Async: keep (and IS-correct) groups older than max_staleness instead of dropping them."},
    )
    async_overlap: bool = field(
        default=False,
        metadata={"help": "Async, in-process: generate during forward and backward, pause for optimizer steps."},
    )
    async_overlap_engine_threads: int | None = field(
        default=None, metadata={"help": "async_overlap on CPU: the engine's intra-op threads (unset: the trainer's)."}
    )
    rollout_server_urls: list[str] | None = field(
        default=None,
        metadata={
            "help": "Generate on `trl-cb serve` replicas at these URLs instead of in-process (prompts split across "
            "them, a dead replica's prompts resubmitted to the others). Sync mode: weights pushed before each step's "
            "first round; multi-process trainers: the main process talks to the servers. With `async_generation`: "
            "the servers generate while the trainer trains, weights pushed after every optimizer step. See "
            "docs/server.md."
        },
    )
    rollout_server_api_key: str | None = field(
        default=None,
        repr=False,  # a secret: masked in every dump (`_SECRET_FIELDS`)
        metadata={"help": "The servers' `--api-key`, sent as 'Authorization: Bearer KEY' (masked in config dumps)."},
    )

    # Deprecated parameters
    use_transformers_paged: bool = field(
        default=False,
        metadata={"help": "Deprecated. Use `use_transformers_continuous_batching` instead."},
    )

    def to_dict(self) -> dict[str, Any]:
        """TRL's dict (what trackers log and `to_json_string` writes) with every secret masked as `<FIELD_NAME>`, as
        `TrainingArguments` masks its `*_token` fields."""
        d = super().to_dict()
        for name in _SECRET_FIELDS:
            if d.get(name) is not None:
                d[name] = f"<{name.upper()}>"
        return d

    def __str__(self) -> str:
        """`TrainingArguments.__str__`'s format (it masks `*_token` fields only), with the secrets masked too."""
        values = asdict(self)
        for name, value in values.items():
            if name.endswith("_token") or (name in _SECRET_FIELDS and value is not None):
                values[name] = f"<{name.upper()}>"
        lines = "".join(f"{name}={value},\n" for name, value in sorted(values.items()))
        return f"{self.__class__.__name__}(\n{lines})"

    def _default_importance_sampling_mode(self) -> str:
        """The IS mode used when the user sets none: TRL's `sequence_mask` for synchronous generation (its weights are
        1 up to numerical noise, and it keeps TRL's semantics); `ASYNC_DEFAULT_IS_MODE` for async generation, whose
        samples are drawn by older weights (chosen by measurement: docs/async.md, "Off-policy correction")."""
        return ASYNC_DEFAULT_IS_MODE if self.async_generation else "sequence_mask"

    def _post_init_continuous_batching(self) -> None:
        """Normalise and validate the CB fields (called first thing in the configs' `__post_init__`)."""
        if self.use_transformers_paged:
            warn_deprecated("use_transformers_paged", "use_transformers_continuous_batching", stacklevel=5)
            self.use_transformers_continuous_batching = True
            # Forwarded: clear it so an installed TRL that has its own shim does not warn a second time.
            self.use_transformers_paged = False

        cb_config: Any = self.transformers_continuous_batching_config
        if isinstance(cb_config, str):
            try:
                cb_config = json.loads(cb_config) if cb_config.strip() else {}
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"transformers_continuous_batching_config is not valid JSON: {err.msg} ({cb_config!r})."
                ) from err
        if cb_config is not None and not isinstance(cb_config, dict):
            raise ValueError(
                "transformers_continuous_batching_config must be a dict or JSON object, got "
                f"{type(cb_config).__name__}."
            )
        self.transformers_continuous_batching_config = cb_kwargs(cb_config)

        self.prefetch_depth = _resolved_prefetch_depth(self.prefetch_depth, self.async_overlap)
        if self.cb_importance_sampling_mode is None:
            self.cb_importance_sampling_mode = self._default_importance_sampling_mode()
        if self.cb_importance_sampling_normalize is None:
            self.cb_importance_sampling_normalize = bool(self.async_generation)
        validate_mode(
            self.cb_importance_sampling_mode,
            self.cb_importance_sampling_clip_min,
            self.cb_importance_sampling_clip_max,
            self.cb_importance_sampling_m2_threshold,
        )
        if self.cb_generation_timeout is not None and self.cb_generation_timeout <= 0:
            raise ValueError(f"cb_generation_timeout must be > 0 or None, got {self.cb_generation_timeout}.")
        if self.cb_keep_generation_weights is not None and not isinstance(self.cb_keep_generation_weights, bool):
            raise ValueError(
                "cb_keep_generation_weights must be True, False or None (auto), got "
                f"{self.cb_keep_generation_weights!r}."
            )
        if self.rollout_server_urls:
            if isinstance(self.rollout_server_urls, str):
                self.rollout_server_urls = [url for url in self.rollout_server_urls.split(",") if url]
            if not self.use_transformers_continuous_batching:
                raise ValueError("rollout_server_urls needs use_transformers_continuous_batching=True.")
        _validate_async_fields(self)
        if self.use_transformers_continuous_batching and getattr(self, "use_vllm", False):
            raise ValueError(
                "use_transformers_continuous_batching and use_vllm are mutually exclusive; enable one of them."
            )


def _resolved_prefetch_depth(prefetch_depth: int | None, async_overlap: bool) -> int:
    """`prefetch_depth`, or its default where unset (`DEFAULT_OVERLAP_PREFETCH_DEPTH` with overlap: why there)."""
    if prefetch_depth is not None:
        return prefetch_depth
    return DEFAULT_OVERLAP_PREFETCH_DEPTH if async_overlap else DEFAULT_PREFETCH_DEPTH


def _validate_async_fields(args: ContinuousBatchingArguments) -> None:
    """`ValueError` for async settings that cannot work together (naming the fix)."""
    if args.async_generation:
        if not args.use_transformers_continuous_batching:
            raise ValueError("async_generation needs use_transformers_continuous_batching=True.")
        if not args.cb_importance_sampling_correction:
            raise ValueError(
                "async_generation trains on samples drawn by older weights; it needs "
                "cb_importance_sampling_correction=True."
            )
        validate_async_bounds(args.max_staleness, args.prefetch_depth)
    if args.async_overlap_engine_threads is not None and args.async_overlap_engine_threads < 1:
        raise ValueError(
            f"async_overlap_engine_threads must be >= 1 or None, got {args.async_overlap_engine_threads}."
        )
    if args.async_overlap:
        if not args.async_generation:
            raise ValueError("async_overlap needs async_generation=True (it is a mode of in-process async).")
        if args.rollout_server_urls:
            raise ValueError(
                "async_overlap is for the in-process engine; rollout servers already generate while the trainer "
                "trains: unset async_overlap or rollout_server_urls."
            )


@dataclass
class GRPOConfig(ContinuousBatchingArguments, trl.GRPOConfig):
    """TRL's `GRPOConfig` with trl_cb's continuous batching fields (see `ContinuousBatchingArguments`)."""

    def _default_importance_sampling_mode(self) -> str:
        # VESPO folds token-level IS weights into its own sequence weight (TRL's `get_gamma_weights`): token level.
        if self.loss_type == "vespo":
            return "token_mask"
        return GRPO_ASYNC_DEFAULT_IS_MODE if self.async_generation else super()._default_importance_sampling_mode()

    def __post_init__(self) -> None:
        self._post_init_continuous_batching()
        with trl_config_post_init(self):  # TRL's own `gradient_checkpointing` default warns otherwise
            super().__post_init__()
        if (
            self.use_transformers_continuous_batching
            and self.cb_importance_sampling_correction
            and self.loss_type == "vespo"
            and not is_token_level(self.cb_importance_sampling_mode)
        ):
            raise ValueError(
                "loss_type='vespo' weights tokens itself and needs a token-level IS mode; set "
                f"cb_importance_sampling_mode to one of {TOKEN_LEVEL_MODES}"
                f" (got {self.cb_importance_sampling_mode!r})."
            )


@dataclass
class RLOOConfig(ContinuousBatchingArguments, trl.RLOOConfig):
    """TRL's `RLOOConfig` with trl_cb's continuous batching fields (see `ContinuousBatchingArguments`).

    RLOO's loss is per sequence; a sequence-level IS mode (`sequence_*`, `geometric_*`) weights its advantage, a
    token-level one (`token_*`) the gradient of each token's logprob (the truncated-IS policy gradient).
    """

    def __post_init__(self) -> None:
        self._post_init_continuous_batching()
        with trl_config_post_init(self):  # TRL's own `gradient_checkpointing` default warns otherwise
            super().__post_init__()
