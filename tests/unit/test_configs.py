"""Config fields, validation and the deprecation shim, for both trainers."""

from __future__ import annotations

import json
import logging
import warnings

import pytest

from trl_cb import ContinuousBatchingArguments, GRPOConfig, RLOOConfig
from trl_cb.deprecation import REMOVAL_VERSION

CONFIGS = [GRPOConfig, RLOOConfig]


def make(cls, **kwargs):
    return cls(output_dir="/tmp/trl_cb_test", report_to=[], use_cpu=True, **kwargs)


@pytest.mark.parametrize("cls", CONFIGS)
def test_defaults(cls):
    cfg = make(cls)
    assert cfg.use_transformers_continuous_batching is False
    assert cfg.transformers_continuous_batching_config == {"max_memory_percent": 0.5}
    assert cfg.cb_importance_sampling_correction is True
    assert cfg.cb_importance_sampling_mode == "sequence_mask"


@pytest.mark.parametrize("cls", CONFIGS)
def test_deprecated_paged_flag_forwards_with_one_warning(cls):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = make(cls, use_transformers_paged=True)
    future = [
        w for w in caught if issubclass(w.category, FutureWarning) and "use_transformers_paged" in str(w.message)
    ]
    assert len(future) == 1, [str(w.message) for w in future]
    message = str(future[0].message)
    assert "use_transformers_continuous_batching" in message and REMOVAL_VERSION in message
    assert future[0].filename == __file__, "the warning must point at the user's line"
    assert cfg.use_transformers_continuous_batching is True


@pytest.mark.parametrize("cls", CONFIGS)
def test_unknown_cb_key_lists_valid_keys(cls):
    with pytest.raises(ValueError, match=r"Unknown continuous batching config key\(s\) \['num_blockz'\].*num_blocks"):
        make(cls, transformers_continuous_batching_config={"num_blockz": 3})


@pytest.mark.parametrize("cls", CONFIGS)
@pytest.mark.parametrize("value", [0, -0.1, 1.5])
def test_max_memory_percent_bounds(cls, value):
    with pytest.raises(ValueError, match=r"max_memory_percent must be in \(0, 1\]"):
        make(cls, transformers_continuous_batching_config={"max_memory_percent": value})


@pytest.mark.parametrize("cls", CONFIGS)
def test_json_string_and_user_memory_percent_kept(cls):
    cfg = make(cls, transformers_continuous_batching_config='{"max_memory_percent": 0.3, "page_size": 64}')
    assert cfg.transformers_continuous_batching_config == {"max_memory_percent": 0.3, "page_size": 64}
    with pytest.raises(ValueError, match="not valid JSON"):
        make(cls, transformers_continuous_batching_config="{page_size: 64")


@pytest.mark.parametrize("cls", CONFIGS)
def test_is_settings_validated(cls):
    with pytest.raises(ValueError, match="Unknown importance sampling mode"):
        make(cls, cb_importance_sampling_mode="sequence_clip")
    with pytest.raises(ValueError, match="must be smaller than"):
        make(cls, cb_importance_sampling_clip_min=2.0, cb_importance_sampling_clip_max=1.0)
    with pytest.raises(ValueError, match="needs clip_min or clip_max"):
        make(cls, cb_importance_sampling_mode="sequence_truncate", cb_importance_sampling_clip_max=None)


def test_rloo_takes_token_level_is():
    """RLOO's sequence-level loss takes token-level weights on its logprobs' gradient (tests/unit/trainers)."""
    for mode in ("token_truncate", "token_mask", "token_m2"):
        assert make(RLOOConfig, cb_importance_sampling_mode=mode).cb_importance_sampling_mode == mode


def test_grpo_vespo_picks_token_mode_when_unset():
    """A user who only flips the CB flag gets the mode VESPO needs; other losses keep the sequence default."""
    cfg = make(GRPOConfig, use_transformers_continuous_batching=True, loss_type="vespo")
    assert cfg.cb_importance_sampling_mode == "token_mask"
    assert make(GRPOConfig, use_transformers_continuous_batching=True).cb_importance_sampling_mode == "sequence_mask"
    explicit = make(
        GRPOConfig,
        use_transformers_continuous_batching=True,
        loss_type="vespo",
        cb_importance_sampling_mode="token_truncate",
    )
    assert explicit.cb_importance_sampling_mode == "token_truncate"


def test_grpo_vespo_refuses_explicit_sequence_mode():
    with pytest.raises(ValueError, match="vespo.*token-level IS mode"):
        make(
            GRPOConfig,
            use_transformers_continuous_batching=True,
            loss_type="vespo",
            cb_importance_sampling_mode="sequence_mask",
        )


@pytest.mark.parametrize("cls", CONFIGS)
def test_cb_and_vllm_are_exclusive(cls):
    with pytest.raises(ValueError, match="mutually exclusive"):
        make(cls, use_transformers_continuous_batching=True, use_vllm=True)


@pytest.mark.parametrize("cls", CONFIGS)
def test_cli_parses_cb_fields(cls):
    from trl import TrlParser

    (cfg,) = TrlParser((cls,)).parse_args_and_config(
        [
            "--output_dir", "/tmp/x", "--use_cpu", "--report_to", "none",
            "--use_transformers_continuous_batching",
            "--transformers_continuous_batching_config", '{"page_size": 16}',
            "--cb_importance_sampling_mode", "sequence_truncate",
        ]
    )  # fmt: skip
    assert cfg.use_transformers_continuous_batching
    assert cfg.transformers_continuous_batching_config == {"page_size": 16, "max_memory_percent": 0.5}
    assert cfg.cb_importance_sampling_mode == "sequence_truncate"


@pytest.mark.parametrize("cls", [GRPOConfig, RLOOConfig])
def test_server_api_key_never_in_a_dump_or_log(cls, caplog):
    """The key is a secret: to_dict (what trackers log), its JSON and sanitized forms, str, repr and a logged config
    all mask it (TrainingArguments masks only `*_token` fields)."""
    secret = "sk-very-secret-4242"
    args = make(
        cls,
        use_transformers_continuous_batching=True,
        cb_server_urls=["http://127.0.0.1:1"],
        cb_server_api_key=secret,
    )
    assert args.cb_server_api_key == secret  # still usable
    with caplog.at_level(logging.INFO):
        logging.getLogger("trl_cb.test").info("config: %s / %r", args, args)
    dumps = {
        "to_dict": json.dumps(args.to_dict()),
        "to_json_string": args.to_json_string(),
        "to_sanitized_dict": json.dumps(args.to_sanitized_dict()),
        "str": str(args),
        "repr": repr(args),
        "log": caplog.text,
    }
    leaked = [name for name, text in dumps.items() if secret in text]
    assert not leaked, f"the API key appears in {leaked}"
    assert "<CB_SERVER_API_KEY>" in dumps["to_dict"]


def test_off_policy_modes_follow_the_loss_level():
    """Geometric and M2 modes are sequence- or token-level like TRL's: VESPO takes the token-level ones only; the M2
    bound must be a positive number."""
    assert make(RLOOConfig, cb_importance_sampling_mode="geometric_truncate").cb_importance_sampling_mode
    assert make(RLOOConfig, cb_importance_sampling_mode="geometric_m2").cb_importance_sampling_mode
    vespo = dict(use_transformers_continuous_batching=True, loss_type="vespo")
    assert make(GRPOConfig, cb_importance_sampling_mode="token_m2", **vespo).cb_importance_sampling_mode == "token_m2"
    with pytest.raises(ValueError, match="token-level IS mode"):
        make(GRPOConfig, cb_importance_sampling_mode="geometric_mask", **vespo)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="m2_threshold"):
            make(GRPOConfig, cb_importance_sampling_mode="token_m2", cb_importance_sampling_m2_threshold=bad)


def test_async_generation_defaults_to_the_off_policy_mode_sync_keeps_trls():
    """Unset, async generation gets the mode measured best for stale samples, self-normalised; synchronous generation
    keeps TRL's `sequence_mask`, unnormalised; an explicit choice wins; VESPO still gets its token-level mode."""
    from trl_cb.configs import ASYNC_DEFAULT_IS_MODE, GRPO_ASYNC_DEFAULT_IS_MODE

    async_cb = dict(use_transformers_continuous_batching=True, cb_async_generation=True)
    assert make(RLOOConfig, **async_cb).cb_importance_sampling_mode == ASYNC_DEFAULT_IS_MODE
    assert make(GRPOConfig, **async_cb).cb_importance_sampling_mode == GRPO_ASYNC_DEFAULT_IS_MODE
    for cls in CONFIGS:
        assert make(cls, **async_cb).cb_importance_sampling_normalize is True
        assert make(cls, use_transformers_continuous_batching=True).cb_importance_sampling_normalize is False
        assert make(cls, cb_importance_sampling_normalize=False, **async_cb).cb_importance_sampling_normalize is False
        assert make(cls, use_transformers_continuous_batching=True).cb_importance_sampling_mode == "sequence_mask"
        explicit = make(cls, cb_importance_sampling_mode="sequence_mask", **async_cb)
        assert explicit.cb_importance_sampling_mode == "sequence_mask"
    vespo = make(GRPOConfig, loss_type="vespo", **async_cb)
    assert vespo.cb_importance_sampling_mode == "token_mask"


@pytest.mark.parametrize("cls", CONFIGS)
def test_prefetch_depth_defaults_to_0_with_overlap_1_otherwise_explicit_wins(cls):
    """Overlap's engine generates through the training step, so its measured default window is one step shorter."""
    from trl_cb.configs import DEFAULT_OVERLAP_PREFETCH_DEPTH, DEFAULT_PREFETCH_DEPTH, prefetch_depth_was_set

    assert (DEFAULT_OVERLAP_PREFETCH_DEPTH, DEFAULT_PREFETCH_DEPTH) == (0, 1)
    async_cb = dict(use_transformers_continuous_batching=True, cb_async_generation=True)
    assert make(cls).cb_async_prefetch_depth == 1
    assert make(cls, **async_cb).cb_async_prefetch_depth == 1
    assert make(cls, cb_async_overlap=True, **async_cb).cb_async_prefetch_depth == 0
    assert make(cls, cb_async_overlap=True, cb_async_prefetch_depth=1, **async_cb).cb_async_prefetch_depth == 1
    # the trainer's tools default (DEFAULT_TOOLS_PREFETCH_DEPTH) applies only where the user set nothing
    assert not prefetch_depth_was_set(make(cls, **async_cb))
    assert prefetch_depth_was_set(make(cls, cb_async_prefetch_depth=1, **async_cb))
    with pytest.raises(ValueError, match="cb_async_prefetch_depth must be >= 0"):
        make(cls, cb_async_prefetch_depth=-1, **async_cb)


def test_docs_reference_table_is_generated_from_the_field_help(monkeypatch):
    """docs/index.md's configuration table is `reference_table()`'s output: the fields' `help` is their one
    documentation. Control: once one field's help changes, the docs no longer match."""
    import dataclasses
    from pathlib import Path

    from trl_cb import configs

    doc = (Path(__file__).resolve().parents[2] / "docs" / "index.md").read_text()
    begin = doc.index("<!-- config reference: generated by trl_cb.configs.reference_table -->\n")
    end = doc.index("<!-- end of config reference -->")
    in_docs = doc[doc.index("\n", begin) + 1 : end]
    fix = 'python -c "from trl_cb.configs import reference_table; print(reference_table())"'
    assert in_docs == configs.reference_table(), f"docs/index.md's config table is stale: paste the output of {fix}"
    fields = dataclasses.fields(configs.ContinuousBatchingArguments)
    assert all(f"| `{f.name}` |" in in_docs for f in fields)
    edited = next(f for f in fields if f.name == "cb_generation_timeout")
    monkeypatch.setattr(edited, "metadata", {**edited.metadata, "help": edited.metadata["help"] + " Edited."})
    assert in_docs != configs.reference_table()


def test_one_naming_scheme():
    """Every field trl_cb adds is `cb_*`; only the fields TRL declares itself keep TRL's names."""
    import dataclasses

    trl_names = {"use_transformers_continuous_batching", "transformers_continuous_batching_config"}
    trl_names.add("use_transformers_paged")  # TRL's own deprecated alias
    for f in dataclasses.fields(ContinuousBatchingArguments):
        assert f.name.startswith("cb_") or f.name in trl_names, f.name
