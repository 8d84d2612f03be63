"""GRPO on GSM8K with trl_cb's continuous-batching rollouts.

Offline, tiny random model and the GSM8K test split shipped with trl_cb, chat-formatted (seconds on a CPU):
    python examples/grpo_gsm8k.py --output_dir /tmp/grpo --max_steps 4

A real model and the real data (needs the hub / the file):
    python examples/grpo_gsm8k.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
        --data_file gsm8k/train.jsonl --num_examples 2000 --output_dir runs/grpo \
        --per_device_train_batch_size 16 --num_generations 8 --max_completion_length 512

Generation on a rollout server, overlapped with training (docs/server.md; same offline tiny model):
    trl-cb serve --model trl-cb/tiny --port 8000 &
    python examples/grpo_gsm8k.py --output_dir /tmp/grpo --max_steps 4 \
        --cb_server_urls http://127.0.0.1:8000 --cb_async_generation

Multi-GPU (see docs/distributed.md):
    accelerate launch --config_file examples/accelerate_configs/zero3.yaml examples/grpo_gsm8k.py ...
"""

from __future__ import annotations

import torch
from datasets import Dataset
from trl import TrlParser

from trl_cb import GRPOConfig, GRPOTrainer
from trl_cb.offline.data import GSM8KScriptArguments, gsm8k_reward, load_prompts
from trl_cb.offline.names import is_tiny_model_name
from trl_cb.offline.tiny import tiny_model_path

DEFAULTS = dict(
    use_transformers_continuous_batching=True,
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=48,
    max_steps=2,
    logging_steps=1,
    learning_rate=1e-5,
    report_to="none",
    save_strategy="no",
)
if not torch.cuda.is_available():  # TRL defaults to bf16, which needs a GPU unless told to run on the CPU
    DEFAULTS.update(use_cpu=True, bf16=False)


def main(script_args: GSM8KScriptArguments, training_args: GRPOConfig) -> None:
    model = script_args.model_name_or_path
    if is_tiny_model_name(model):  # rank 0 first: under torch.distributed only rank 0 writes checkpoint files
        with training_args.main_process_first(local=False):
            model = tiny_model_path()
    dataset = Dataset.from_list(load_prompts(script_args, seed=training_args.seed))
    trainer = GRPOTrainer(model=model, reward_funcs=gsm8k_reward, args=training_args, train_dataset=dataset)
    trainer.train()
    print({k: v for k, v in trainer.state.log_history[-1].items()})


if __name__ == "__main__":
    parser = TrlParser((GSM8KScriptArguments, GRPOConfig))
    parser.set_defaults(**DEFAULTS)
    main(*parser.parse_args_and_config())
