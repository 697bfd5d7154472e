"""python -m grpo_jax train --config configs/qwen3_30b_a3b_gpu.py --set model.hf_path=/models/Qwen3-30B-A3B --set task.options.path=data/gsm8k_train.jsonl

GRPO with LoRA adapters on Qwen3-30B-A3B (30.5B parameters, 3.3B active per token) on one machine
of 8 x H100 80GB, completions up to 8,192 tokens. Before running:

    python -m grpo_jax check --config configs/qwen3_30b_a3b_gpu.py --model-shape qwen3-30b-a3b \\
        --devices 8 --memory-per-device 80GiB

Training every weight does not fit 8 cards: float32 masters, Adam and gradients are 16 B a
parameter, 61 GB a card before the sampler's copy and any activation. So the base is frozen in
bf16 (61 GB in all) and rank-16 adapters train on the attention projections (the sparse layers
have no dense MLP; the target `experts` would add the experts, with train.export_peft=false).
tensor=4 splits heads, vocabulary and each expert's width (15 GB of base a card, one KV head
each); data=2 splits the rows. The sampler takes a merged bf16 copy (another 15 GB). 16 prompts
x 8 completions = 128 rows, 64 a card; the update takes one row a card per micro-batch.

Measured by `check` (compiled on 8 fake CPU devices, 4 minutes), per card: state 14.4 GiB;
rollout 67 GiB (fits), log-prob pass 90 GiB and update 192 GiB (over 80 GiB) at 8,192 new tokens;
before each device routed its own tokens, 84, 159 and 412 GiB. Much of the update's scratch is
what XLA:CPU keeps of every sparse layer's tiled grouped matmul until its backward (see
configs/qwen3_30b_a3b_tpu.py); a compile on the GPU itself is the figure to trust.
"""

from grpo_jax.config import (Config, EvalSection, GRPOSection, LoraSection, MeshSection, ModelSection,
                             OptimSection, RewardsSection, SamplingSection, TaskSection, TrainSection)


def get_config() -> Config:
    return Config(
        model=ModelSection(hf_path="/models/Qwen3-30B-A3B", dtype="bfloat16", remat=True),
        lora=LoraSection(r=16, alpha=32.0, target_modules=("attention",), base_dtype="bfloat16"),
        mesh=MeshSection(data=-1, fsdp=1, tensor=4),
        task=TaskSection(name="jsonl", options={"path": "data/gsm8k_train.jsonl", "template": "r1",
                                                "answer_format": "gsm8k", "format_weight": 0.2, "chat": True}),
        sampling=SamplingSection(max_new_tokens=8192, temperature=1.0),
        grpo=GRPOSection(prompts_per_step=16, num_generations=8, eps_low=0.2, eps_high=0.28, beta=0.0,
                         aggregation="token", num_iterations=1, num_minibatches=2, grad_accum_steps=32,
                         mask_truncated_completions=True),
        optim=OptimSection(learning_rate=1e-5, schedule="cosine", warmup_steps=20, b2=0.99,
                           weight_decay=0.0, max_grad_norm=1.0),
        eval=EvalSection(every=50, num_questions=256, num_samples=4, ks=(1, 4), temperature=1.0),
        train=TrainSection(steps=500, seed=0, run_dir="runs/qwen3_30b_a3b_gpu", samples_every=10,
                           checkpoint_every=50, keep_checkpoints=3, export_hf=True),
        rewards=RewardsSection(workers=8),
    )
