"""Tiny random-init models and a locally trained tokenizer: the offline default for tests, examples and benchmarks.

Why: nothing in the default run may download weights. A real architecture (Qwen2 or Llama) built from a config with
random weights exercises exactly the code paths a real checkpoint does (paged attention, logits processors, the TRL
loss), and a byte-level BPE tokenizer trained in memory on GSM8K-style text gives realistic prompt lengths.

Invariant: `tiny_model(seed=s)` returns identical weights for the same seed on every machine (CPU, fp32).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
)

from .data import corpus_for_tokenizer
from .names import TINY_MODEL, TINY_MODELS, is_tiny_model_name

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>")
# A minimal plain-text chat template, so chat-formatted prompts (the default data, see offline/data.py) work offline.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def tiny_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained in memory on synthetic GSM8K text (deterministic, ~50 ms), with a
    plain-text chat template (`CHAT_TEMPLATE`)."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_for_tokenizer(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    architecture: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int | None = None,
    seed: int = 0,
    eos_logit_bias: float | None = None,
    dtype: torch.dtype = torch.float32,
    init_std: float | None = None,
    num_attention_heads: int | None = None,
    intermediate_size: int | None = None,
) -> PreTrainedModel:
    """A random-init causal LM sized to `tokenizer`, on CPU, in train mode off (eval), `sdpa` attention.

    Heads default to `hidden_size // 16` (head dim 16), the MLP to `2 * hidden_size`; key/value heads are half the
    query heads (grouped-query attention, as in Qwen2/Llama).

    `eos_logit_bias`: if set, the EOS row of the output projection is replaced by a fixed direction scaled so that
    EOS gets roughly that logit offset against an average token. A random model never stops on its own (EOS has
    probability ~1/vocab per step); a bias makes completion lengths vary per sample, like real rollouts, which is
    what continuous batching exploits. `None` keeps the plain random init.

    `init_std`: standard deviation of the random weights (transformers' `initializer_range`, 0.02 by default). At
    0.02 next-token distributions are nearly uniform, so a logprob comparison on them proves little; tests that
    compare logprobs use 0.2 (distributions far from uniform).

    `architecture="qwen3_5"`: Qwen3.5's hybrid layout, three Gated DeltaNet layers then one full-attention layer
    (`num_layers` a multiple of 4; unset: 4, else 2), linear-attention heads of 16 (as many value heads as query
    heads, half as many key heads).
    """
    classes = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
    }
    if architecture not in classes:
        raise ValueError(f"architecture must be one of {sorted(classes)}, got {architecture!r}")
    config_cls, model_cls = classes[architecture]
    heads = num_attention_heads or max(2, hidden_size // 16)
    extra = {}
    if num_layers is None:
        num_layers = 4 if architecture == "qwen3_5" else 2
    if architecture == "qwen3_5":
        if num_layers % 4:
            raise ValueError(f"the qwen3_5 layout repeats 3 linear-attention + 1 full-attention layers: {num_layers=}")
        extra = dict(
            head_dim=hidden_size // heads, linear_num_value_heads=heads, linear_num_key_heads=max(1, heads // 2),
            linear_key_head_dim=16, linear_value_head_dim=16,
        )  # fmt: skip
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        **extra,
    )
    if init_std is not None:
        config.initializer_range = init_std
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # The class constructor, not `from_config`: under an active DeepSpeed ZeRO-3 config, `from_config` would
        # partition the weights at init; the tiny model is built whole and handed to the trainer like any checkpoint.
        model = model_cls(config).to(dtype)
        model.set_attn_implementation("sdpa")
        if eos_logit_bias is not None:
            bias_eos(model, tokenizer.eos_token_id, eos_logit_bias)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model.eval()


def small_model(
    tokenizer: PreTrainedTokenizerFast,
    seed: int = 0,
    eos_logit_bias: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """The compute-heavier CPU preset: Qwen2, 8 layers x 256 wide, 4 heads of 64 (2 KV heads), MLP 1024 (~8.1 M
    parameters with the 512-token vocabulary).

    Why: on the 64-wide, 2-layer `tiny_model` a forward costs less than the per-step Python and scheduling overhead
    around it, which hides what matters on real models (matmul and attention work, thread scaling). This preset has
    ~75x the FLOPs per token and a realistic head dimension while still running a benchmark in minutes on 2 cores.
    """
    return tiny_model(
        tokenizer,
        hidden_size=256,
        num_layers=8,
        num_attention_heads=4,
        intermediate_size=1024,
        seed=seed,
        eos_logit_bias=eos_logit_bias,
        dtype=dtype,
    )


@torch.no_grad()
def bias_eos(model: PreTrainedModel, eos_id: int, bias: float) -> None:
    """Point the EOS output row along the mean final hidden state so EOS gets a steady, context-dependent boost.

    The final RMSNorm output has a non-zero mean direction for a random model; aligning W_eos with it (scaled) adds
    about `bias` to the EOS logit on average while the context still moves it, which yields a long-tailed length
    distribution rather than a constant one.
    """
    probe = torch.randint(3, model.config.vocab_size, (8, 32), device=model.lm_head.weight.device)
    hidden = model.model(input_ids=probe).last_hidden_state.reshape(-1, model.config.hidden_size)  # (8*32, H)
    direction = hidden.mean(0)
    scale = bias / max(float(direction.norm() ** 2), 1e-6)
    model.lm_head.weight[eos_id] = direction * scale


def tiny_checkpoint(directory: str | Path, eos_logit_bias: float | None = 4.0, seed: int = 0) -> str:
    """Save (once) the tiny model and tokenizer to `directory` and return its path.

    TRL trainers load a policy — and a reference model when `beta > 0` — from a path; a saved tiny checkpoint lets
    the examples run the exact user-facing path offline.

    Safe when several processes ask at once: each writes a private sibling directory and renames it into place; the
    first rename wins and the others discard theirs, so no reader sees a partial checkpoint. Under torch.distributed
    transformers writes checkpoints from rank 0 only: there, call it on rank 0 first (`main_process_first`).
    """
    directory = Path(directory)
    complete = ("config.json", "chat_template.jinja")  # a checkpoint saved before the chat template is rebuilt
    if not all((directory / name).is_file() for name in complete):
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
        tokenizer = tiny_tokenizer()
        tiny_model(tokenizer, eos_logit_bias=eos_logit_bias, seed=seed).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if not (staging / "config.json").is_file():  # transformers writes from rank 0 only under torch.distributed
            shutil.rmtree(staging, ignore_errors=True)
            raise RuntimeError(
                f"Could not write the tiny checkpoint to {directory} from this process (not rank 0 of a "
                "torch.distributed run): build it on rank 0 first, or once before launching."
            )
        if (directory / "config.json").is_file() and not (directory / "chat_template.jinja").is_file():
            shutil.rmtree(directory, ignore_errors=True)  # an outdated checkpoint: replaced below
        try:
            staging.rename(directory)
        except OSError:  # another process renamed its copy first (or a stale non-empty directory is there)
            shutil.rmtree(staging, ignore_errors=True)
            if not all((directory / name).is_file() for name in complete):
                raise
    return str(directory)


def resolve_model_name(name_or_path: str) -> str:
    """An offline name (`offline/names.py`: `trl-cb/tiny`, ...) becomes its local tiny checkpoint; hub ids and paths
    pass through unchanged. The one rule every command that takes a model name applies."""
    return tiny_model_path(name_or_path) if is_tiny_model_name(name_or_path) else name_or_path


def tiny_model_path(name: str = TINY_MODEL) -> str:
    """Directory of an offline tiny checkpoint (`offline/names.py`), built on first use under the temp directory
    (shared by the CLI and the examples; under torch.distributed call it on rank 0 first, see `tiny_checkpoint`)."""
    directory, eos_logit_bias = TINY_MODELS[name]
    return tiny_checkpoint(Path(tempfile.gettempdir()) / directory, eos_logit_bias=eos_logit_bias)
