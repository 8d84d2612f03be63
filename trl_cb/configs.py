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
- `cb_async_prefetch_depth` is an int: unset, 0 with `cb_async_overlap`, else 1 (a trainer with tools writes 0).
"""

from __future__ import annotations

import json
import numbers
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import trl

from .checks.engine_config import DEFAULT_MAX_MEMORY_PERCENT, cb_kwargs
from .checks.inputs import check_type
from .deprecation import warn_deprecated
from .importance_sampling import DEFAULT_M2_THRESHOLD, IS_MODES, TOKEN_LEVEL_MODES, is_token_level, validate_mode
from .upstream_warnings import trl_config_post_init

#: `cb_async_prefetch_depth` when unset. Overlap's engine keeps generating through the training step, so its
#: staleness is one step above the held engine's at the same depth: measured at 6 seeds, depth 0 gives it staleness
#: 0.98 and sync's learning curve, depth 1 staleness 1.93 and 1.08-1.20x samples (docs/async.md).
DEFAULT_PREFETCH_DEPTH = 1
DEFAULT_OVERLAP_PREFETCH_DEPTH = 0
#: `cb_async_prefetch_depth` when unset and the trainer has tools or environments (multi-turn rollouts), applied by the
#: trainer (the config does not know its tools; `default_prefetch_depth` tells the trainer which default). Measured on
#: the long-tailed tool task (docs/benchmarks.md, "Multi-turn agents"; 10 seeds in two runs of every backend): at
#: depth 1 (staleness up to 2) 5 runs of 10 ended collapsed (evaluated reward < 0.5 at the last step), at depth 0 1 of
#: 10, as sync (1 of 10); step time 0.27x sync's instead of 0.20x. At lr 2e-3 (sync stable): depth 0 0.92x sync's
#: samples, depth 1 collapsed 2 runs of 6.
DEFAULT_TOOLS_PREFETCH_DEPTH = 0

#: The IS modes for `cb_async_generation=True` when none is set, self-normalised (`cb_importance_sampling_normalize`):
#: RLOO (a sequence-level loss) one weight per sequence, the geometric mean of its token ratios, clamped; GRPO one
#: weight per token, clamped (truncated IS). Measured against the other modes on stale samples: docs/async.md,
#: "Off-policy correction: which mode for stale samples".
ASYNC_DEFAULT_IS_MODE = "geometric_truncate"
GRPO_ASYNC_DEFAULT_IS_MODE = "token_truncate"

#: Fields holding secrets: masked in `to_dict`, `str` and `repr` (`repr=False`).
_SECRET_FIELDS = ("cb_server_api_key",)


@dataclass
class ContinuousBatchingArguments:
    """CB fields shared by `GRPOConfig` and `RLOOConfig` (a mixin: use those, not this class directly).

    One vocabulary, as TRL names its vLLM fields `vllm_*`: every field trl_cb adds starts with `cb_` (`cb_async_*` for
    async rollouts, `cb_server_*` for rollout servers, `cb_importance_sampling_*` for the IS correction); the two
    fields TRL itself declares keep TRL's names. Each field is documented once, in its `help`: `--help` on the command
    line prints it and docs/index.md's reference table is generated from it (`reference_table`).
    """

    use_transformers_continuous_batching: bool = field(
        default=False,
        metadata={
            "help": "Generate rollouts with trl_cb's continuous batching engine: one persistent engine sized from the "
            "workload, the sampled tokens' logprobs recorded, the loss importance-sampling corrected."
        },
    )
    transformers_continuous_batching_config: dict | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for `transformers.generation.ContinuousBatchingConfig` (a dict, or a JSON "
            "string on the command line); unknown keys raise, listing the valid ones. Cache geometry left unset "
            "(`num_blocks`, `max_batch_tokens`, `page_size`) is sized from the workload; `max_memory_percent` caps "
            f"it, in (0, 1], {DEFAULT_MAX_MEMORY_PERCENT} unless set. `return_logprobs` is always on. On CUDA, "
            "`use_cuda_graph` turns the engine's CUDA graphs on or off."
        },
    )
    cb_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "Correct the policy-gradient term for the gap between the sampler's and the trainer's logprobs."
        },
    )
    cb_importance_sampling_mode: str | None = field(
        default=None,
        metadata={
            "help": f"Importance-sampling mode, one of {', '.join(IS_MODES)} (docs/index.md, 'Importance-sampling "
            "correction'). Unset: the mode the loss needs, 'sequence_mask'; with cb_async_generation "
            f"'{GRPO_ASYNC_DEFAULT_IS_MODE}' (GRPO) or '{ASYNC_DEFAULT_IS_MODE}' (RLOO); 'token_mask' for GRPO's "
            "loss_type='vespo', which accepts token-level modes only. Only an explicit choice the loss cannot use "
            "raises.",
            "choices": list(IS_MODES),
        },
    )
    cb_importance_sampling_clip_min: float | None = field(
        default=None,
        metadata={"help": "Lower importance-sampling bound (truncate: clamp; mask: weight 0 below)."},
    )
    cb_importance_sampling_clip_max: float | None = field(
        default=3.0,
        metadata={"help": "Upper importance-sampling bound (truncate: clamp; mask: weight 0 above; *_m2: clamp)."},
    )
    cb_importance_sampling_normalize: bool | None = field(
        default=None,
        metadata={
            "help": "Divide the IS weights by their batch mean (self-normalised IS: stale samples' weights average "
            "below 1 and would otherwise shrink the step). Unset: on with cb_async_generation, off otherwise."
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
        metadata={"help": "Seconds one generation round may take before it raises TimeoutError (unset: no limit)."},
    )
    cb_keep_generation_weights: bool | None = field(
        default=None,
        metadata={
            "help": "With bf16/fp16 (or cast_lm_head_to_fp32) generation runs on copies of the weights in the "
            "generation dtype. True: keep them between rounds (+2 bytes per fp32 parameter, all the time); False: "
            "make and free them every round (the same bytes, during rounds only). Unset: keep, unless the parameters "
            "are sharded (ZeRO-3, FSDP), where a kept copy would be the whole model on every rank "
            "(docs/distributed.md)."
        },
    )
    cb_openmp_guard: bool | None = field(
        default=None,
        metadata={
            "help": "While the generator lives, make parked OpenMP workers sleep instead of spin: CPU training stays "
            "fast on a loaded machine, at 5 to 10 percent of a quiet step. Process-wide. Unset: on for a CPU model "
            "with a multi-threaded OpenMP torch, off otherwise."
        },
    )
    cb_async_generation: bool = field(
        default=False,
        metadata={
            "help": "Keep the engine generating across training steps (bounded staleness, partial rollouts, IS with "
            "behaviour logprobs). Single process or DDP in-process, any trainer with cb_server_urls; docs/async.md."
        },
    )
    cb_async_max_staleness: int | None = field(
        default=None,
        metadata={
            "help": "Async: largest accepted age of a group's oldest token, in optimizer steps. Unset: "
            "(cb_async_prefetch_depth + 1) * k, with k = steps_per_generation * num_iterations / "
            "gradient_accumulation_steps optimizer steps between rollout takes: a group waits at most that long, so "
            "nothing is dropped; the trainer writes the bound it runs with here (what is logged is what ran)."
        },
    )
    cb_async_prefetch_depth: int | None = field(
        default=None,
        metadata={
            "help": "Async: steps of prompts kept submitted ahead of the current step. Unset: 0 with "
            "cb_async_overlap or with tools / environments (multi-turn: docs/async.md), 1 otherwise."
        },
    )
    cb_async_keep_stale: bool = field(
        default=False,
        metadata={
            "help": "Async: keep (and IS-correct) groups older than cb_async_max_staleness instead of dropping (and "
            "counting) them."
        },
    )
    cb_async_overlap: bool = field(
        default=False,
        metadata={
            "help": "Async, in-process: the engine generates during forward and backward on a view of the training "
            "weights and pauses only for optimizer steps. Single process or DDP (docs/async.md, 'Overlap')."
        },
    )
    cb_async_overlap_engine_threads: int | None = field(
        default=None,
        metadata={"help": "cb_async_overlap on CPU: the engine's intra-op threads (unset: the trainer's)."},
    )
    cb_async_tool_workers: int = field(
        default=8,
        metadata={
            "help": "Async with tools or environments: samples whose tool calls run at once (worker threads; 1 for "
            "tools that must not run concurrently). See docs/async.md, 'Multi-turn'."
        },
    )
    cb_async_tool_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Async with tools: seconds a tool call may take; past it the call answers {'error': ...} and "
            "counts as a failure, as a raising tool does in TRL. Unset: no limit."
        },
    )
    cb_server_urls: list[str] | None = field(
        default=None,
        metadata={
            "help": "Generate on `trl-cb serve` replicas at these URLs instead of in-process (prompts split across "
            "them, a dead replica's prompts resubmitted to the others). Sync: weights pushed before each step's first "
            "round; with cb_async_generation the servers generate while the trainer trains, weights pushed after "
            "every optimizer step. Multi-process trainers: the main process talks to the servers. docs/server.md."
        },
    )
    cb_server_api_key: str | None = field(
        default=None,
        repr=False,  # a secret: masked in every dump (`_SECRET_FIELDS`)
        metadata={"help": "The servers' --api-key, sent as 'Authorization: Bearer KEY' (masked in config dumps)."},
    )

    # Deprecated parameters
    use_transformers_paged: bool = field(
        default=False,
        metadata={
            "help": "Deprecated (TRL's name): use use_transformers_continuous_batching. One FutureWarning naming the "
            "removal version; turns the new flag on."
        },
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
        return ASYNC_DEFAULT_IS_MODE if self.cb_async_generation else "sequence_mask"

    def _post_init_continuous_batching(self) -> None:
        """Normalise and validate the CB fields (called first thing in the configs' `__post_init__`)."""
        _check_field_types(self)
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

        self._cb_prefetch_depth_was_set = self.cb_async_prefetch_depth is not None
        self._cb_max_staleness_was_set = self.cb_async_max_staleness is not None
        self.cb_async_prefetch_depth = _resolved_prefetch_depth(self.cb_async_prefetch_depth, self.cb_async_overlap)
        if self.cb_importance_sampling_mode is None:
            self.cb_importance_sampling_mode = self._default_importance_sampling_mode()
        if self.cb_importance_sampling_normalize is None:
            self.cb_importance_sampling_normalize = bool(self.cb_async_generation)
        validate_mode(
            self.cb_importance_sampling_mode,
            self.cb_importance_sampling_clip_min,
            self.cb_importance_sampling_clip_max,
            self.cb_importance_sampling_m2_threshold,
        )
        if self.cb_generation_timeout is not None and self.cb_generation_timeout <= 0:
            raise ValueError(f"cb_generation_timeout must be > 0 or None, got {self.cb_generation_timeout}.")
        if self.cb_server_urls:
            if isinstance(self.cb_server_urls, str):
                self.cb_server_urls = [url for url in self.cb_server_urls.split(",") if url]
            if not self.use_transformers_continuous_batching:
                raise ValueError("cb_server_urls needs use_transformers_continuous_batching=True.")
        _validate_async_fields(self)
        if self.use_transformers_continuous_batching and getattr(self, "use_vllm", False):
            raise ValueError(
                "use_transformers_continuous_batching and use_vllm are mutually exclusive; enable one of them."
            )


def reference_table() -> str:
    """docs/index.md's configuration reference, generated from the fields' `help` (their one documentation): a
    markdown table of every field `ContinuousBatchingArguments` adds, in declaration order."""
    rows = ["| field | default | meaning |", "|---|---|---|"]
    for f in fields(ContinuousBatchingArguments):
        default = "unset" if f.default is None else f"`{f.default!r}`"
        meaning = f.metadata["help"].replace("|", "\\|")
        rows.append(f"| `{f.name}` | {default} | {meaning} |")
    return "\n".join(rows) + "\n"


#: Annotated types of the CB fields -> the runtime types accepted (a list field also takes the CLI's comma string).
_ANNOTATION_TYPES: dict[Any, tuple[type, ...]] = {
    bool: (bool,),
    int: (numbers.Integral,),
    float: (numbers.Real,),
    str: (str,),
    dict: (dict,),
    list: (list, tuple, str),
}


def _check_field_types(args: ContinuousBatchingArguments) -> None:
    """`TypeError` naming the field for a value of the wrong type (`cb_generation_timeout="10"`, a count of 2.5),
    read from the fields' own annotations: one rule for every field, new ones included."""
    for name, annotation in typing.get_type_hints(ContinuousBatchingArguments).items():
        parts = (
            typing.get_args(annotation)
            if typing.get_origin(annotation) in (types.UnionType, typing.Union)
            else (annotation,)
        )
        kinds = tuple(
            kind
            for part in parts
            if part is not type(None)
            for kind in _ANNOTATION_TYPES[typing.get_origin(part) or part]
        )
        check_type(name, getattr(args, name), kinds, optional=type(None) in parts)


def prefetch_depth_was_set(args: Any) -> bool:
    """Whether the user chose `cb_async_prefetch_depth` (not the default `__post_init__` filled in). A config built
    otherwise (no `__post_init__` of ours) counts as set."""
    return bool(getattr(args, "_cb_prefetch_depth_was_set", True))


def max_staleness_was_set(args: Any) -> bool:
    """Whether the user chose `cb_async_max_staleness` (unset, the trainer resolves it and writes what runs into its
    args). A config built otherwise counts as set where it holds a value."""
    return bool(getattr(args, "_cb_max_staleness_was_set", True)) and args.cb_async_max_staleness is not None


def default_prefetch_depth(overlap: bool, multi_turn: bool = False) -> int:
    """`cb_async_prefetch_depth` where the user set none: `DEFAULT_TOOLS_PREFETCH_DEPTH` for a trainer with tools or
    environments, `DEFAULT_OVERLAP_PREFETCH_DEPTH` with overlap, else `DEFAULT_PREFETCH_DEPTH`. Derived from the unset
    state each time, never from a value a trainer wrote: a config reused by a trainer without tools gets its own
    default back."""
    if multi_turn:
        return DEFAULT_TOOLS_PREFETCH_DEPTH
    return DEFAULT_OVERLAP_PREFETCH_DEPTH if overlap else DEFAULT_PREFETCH_DEPTH


def _resolved_prefetch_depth(prefetch_depth: int | None, overlap: bool) -> int:
    """`cb_async_prefetch_depth`, or its default where unset (`default_prefetch_depth`)."""
    return default_prefetch_depth(overlap) if prefetch_depth is None else prefetch_depth


def _validate_async_fields(args: ContinuousBatchingArguments) -> None:
    """`ValueError` for async settings that cannot work together (naming the fix)."""
    if args.cb_async_generation:
        if not args.use_transformers_continuous_batching:
            raise ValueError("cb_async_generation needs use_transformers_continuous_batching=True.")
        if not args.cb_importance_sampling_correction:
            raise ValueError(
                "cb_async_generation trains on samples drawn by older weights; it needs "
                "cb_importance_sampling_correction=True."
            )
        if (args.cb_async_max_staleness is not None and args.cb_async_max_staleness < 0) or (
            args.cb_async_prefetch_depth < 0
        ):
            raise ValueError(
                "cb_async_max_staleness and cb_async_prefetch_depth must be >= 0, got "
                f"{args.cb_async_max_staleness}, {args.cb_async_prefetch_depth}."
            )
    if args.cb_async_tool_workers < 1 or (args.cb_async_tool_timeout is not None and args.cb_async_tool_timeout <= 0):
        raise ValueError(
            "cb_async_tool_workers must be >= 1 and cb_async_tool_timeout > 0 or None, got "
            f"{args.cb_async_tool_workers}, {args.cb_async_tool_timeout}."
        )
    if args.cb_async_overlap_engine_threads is not None and args.cb_async_overlap_engine_threads < 1:
        raise ValueError(
            f"cb_async_overlap_engine_threads must be >= 1 or None, got {args.cb_async_overlap_engine_threads}."
        )
    if args.cb_async_overlap_engine_threads is not None and not args.cb_async_overlap:
        raise ValueError("cb_async_overlap_engine_threads sets the overlapping engine's threads: set cb_async_overlap")
    if args.cb_async_overlap:
        if not args.cb_async_generation:
            raise ValueError("cb_async_overlap needs cb_async_generation=True (it is a mode of in-process async).")
        if args.cb_server_urls:
            raise ValueError(
                "cb_async_overlap is for the in-process engine; rollout servers already generate while the trainer "
                "trains: unset cb_async_overlap or cb_server_urls."
            )


@dataclass
class GRPOConfig(ContinuousBatchingArguments, trl.GRPOConfig):
    """TRL's `GRPOConfig` with trl_cb's continuous batching fields (see `ContinuousBatchingArguments`)."""

    def _default_importance_sampling_mode(self) -> str:
        # VESPO folds token-level IS weights into its own sequence weight (TRL's `get_gamma_weights`): token level.
        if self.loss_type == "vespo":
            return "token_mask"
        return GRPO_ASYNC_DEFAULT_IS_MODE if self.cb_async_generation else super()._default_importance_sampling_mode()

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
