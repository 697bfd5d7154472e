"""python -m grpo_jax train --config configs/tpu_pod.py --set model.hf_path=/mnt/models/Qwen2.5-7B-Instruct --set task.options.path=/mnt/data/gsm8k_train.jsonl

GRPO on a TPU pod slice of 16 chips (a v5p-32; `check` puts its update at 26.9 GiB per chip, more
than a v5e-16's 16 GiB; with `--set lora.r=16 --set lora.base_dtype=bfloat16` the weights'
state falls from 7.1 to 1.0 GiB per chip, the update to 20.4 GiB): a 7B-class Hugging Face
checkpoint, GSM8K-style JSONL data.
Run the same command on every worker of the slice (launch/tpu_pod.sh does that through gcloud); JAX's
multi-controller runtime joins them. Paths must be readable on every worker. Before renting the slice, `python -m grpo_jax check --config
configs/tpu_pod.py --model-shape qwen2.5-7b --devices 16 --memory-per-device 95GB` prints what each chip
holds (README, "Scaling"); 16 micro-batches of 16 rows put 4 rows of 1,536 tokens on each chip.
"""

from grpo_jax.config import (Config, EvalSection, GRPOSection, MeshSection, ModelSection, OptimSection,
                             RewardsSection, SamplingSection, TaskSection, TrainSection)


def get_config() -> Config:
    return Config(
        model=ModelSection(hf_path="/mnt/models/Qwen2.5-7B-Instruct",
                           dtype="bfloat16", remat=True),
        # tensor=4 splits heads, MLP width and vocabulary (28 heads, 4 KV heads); fsdp takes the
        # rest of the slice (4 on a v5e-16). Without tensor the sampler's copy (whole along fsdp)
        # would be the whole bf16 model, 15 GB, on every chip.
        mesh=MeshSection(data=1, fsdp=-1, tensor=4),
        task=TaskSection(name="jsonl", options={"path": "/mnt/data/gsm8k_train.jsonl", "template": "r1",
                                                "answer_format": "gsm8k", "format_weight": 0.2}),
        sampling=SamplingSection(max_new_tokens=1024, temperature=1.0),
        grpo=GRPOSection(prompts_per_step=64, num_generations=16, eps_low=0.2, eps_high=0.28, beta=0.0,
                         aggregation="token", num_iterations=1, num_minibatches=4, grad_accum_steps=16,
                         dynamic_sampling=True, mask_truncated_completions=True),
        optim=OptimSection(learning_rate=1e-6, schedule="cosine", warmup_steps=20, b2=0.99,
                           weight_decay=0.01, max_grad_norm=1.0),
        eval=EvalSection(every=50, num_questions=512, num_samples=8, ks=(1, 8)),
        train=TrainSection(steps=1000, seed=0, run_dir="gs://YOUR_BUCKET/grpo_jax/tpu_pod", samples_every=10,
                           checkpoint_every=25, keep_checkpoints=3, export_hf=True),
        rewards=RewardsSection(workers=8),
    )
