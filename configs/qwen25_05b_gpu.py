"""python -m grpo_jax train --config configs/qwen25_05b_gpu.py --set model.hf_path=/models/Qwen2.5-0.5B-Instruct --set task.options.path=data/gsm8k_train.jsonl

GRPO on a Qwen2.5-0.5B-class model on one or more local GPUs, GSM8K-style JSONL data, R1 template.
Weights are never downloaded: `model.hf_path` is a local Hugging Face directory (config.json,
*.safetensors, tokenizer.json). The data file holds one {"question": ..., "answer": ...} object per
line; GSM8K's "#### 42" answers are understood. Each question is asked as a chat turn through the
checkpoint's own chat template (`chat: True`), in training, in held-out evaluation and in `eval`. bf16 compute and a bf16 reference keep the policy,
the reference and Adam state of a 0.5B model within a few GiB.
"""

from grpo_jax.config import (Config, EvalSection, GRPOSection, ModelSection, OptimSection, RewardsSection,
                             SamplingSection, TaskSection, TrainSection)


def get_config() -> Config:
    return Config(
        model=ModelSection(hf_path="/models/Qwen2.5-0.5B-Instruct",
                           dtype="bfloat16"),
        task=TaskSection(name="jsonl", options={"path": "data/gsm8k_train.jsonl", "template": "r1",
                                                "answer_format": "gsm8k", "format_weight": 0.2,
                                                "chat": True}),
        sampling=SamplingSection(max_new_tokens=512, temperature=1.0),
        grpo=GRPOSection(prompts_per_step=16, num_generations=8, eps_low=0.2, eps_high=0.28, beta=0.04,
                         aggregation="token", num_iterations=1, num_minibatches=2, grad_accum_steps=2,
                         ref_dtype="bfloat16", mask_truncated_completions=True),
        optim=OptimSection(learning_rate=1e-6, schedule="cosine", warmup_steps=20, b2=0.99,
                           weight_decay=0.01, max_grad_norm=1.0),
        eval=EvalSection(every=50, num_questions=256, num_samples=4, ks=(1, 4), temperature=1.0),
        train=TrainSection(steps=500, seed=0, run_dir="runs/qwen25_05b_gpu", samples_every=10,
                           checkpoint_every=50, keep_checkpoints=3, export_hf=True),
        rewards=RewardsSection(workers=4),
    )
