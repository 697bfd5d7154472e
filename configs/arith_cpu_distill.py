"""python -m grpo_jax train --config configs/arith_cpu_distill.py

On-policy distillation on the CPU demo's task. A smaller student (width 96, 3 heads, ~0.30M
parameters against the demo's 0.53M) samples its own answers and is trained on its reverse KL to a
teacher over the teacher's top 4 tokens at every answer token (grpo.loss_top_k = 4, with the tail
bucket), beside GRPO's verifier reward (grpo.teacher_tau = 1). The teacher is the CPU demo's trained
policy; make it first (2-3 minutes on the 2-core CPU machine, nothing downloaded), then run this:

    python -m grpo_jax train --config configs/arith_cpu.py --set train.export_hf=true
    python -m grpo_jax train --config configs/arith_cpu_distill.py

GRPO alone, for comparison (the same student, seed, warm-up and steps):

    python -m grpo_jax train --config configs/arith_cpu_distill.py \\
        --set grpo.teacher_model_name_or_path=null --run-dir runs/arith_cpu_distill_grpo

Measured (README, "On-policy distillation"; benchmarks/NOTES.md): after the same SFT warm-up
(greedy 0.22), 300 steps reach greedy held-out accuracy 0.66 with the teacher (pass@1 0.291) and
0.185 with GRPO alone (pass@1 0.119); the teacher's pass makes a step 1.7x as long.
"""

from grpo_jax.config import (Config, EvalSection, GRPOSection, ModelSection, OptimSection, SamplingSection,
                               SFTSection, TaskSection, TrainSection)


def get_config() -> Config:
    return Config(
        model=ModelSection(tokenizer="char:0123456789+=", hidden_size=96, intermediate_size=384,
                           num_layers=2, num_heads=3, num_kv_heads=3, head_dim=32, init_seed=1),
        task=TaskSection(name="arithmetic", options={"digits": 2, "operators": "+", "reverse_answer": True,
                                                     "template": "compact", "seed": 1}),
        sampling=SamplingSection(max_new_tokens=5, temperature=1.0),
        # The sampled-token estimate (loss_top_k=0) needs only the teacher's log-prob of each sampled
        # token but is noisy at this batch size: on this student it first fell to 0.09 greedy and
        # reached 0.305 at step 200, against 0.445 for the top-4 KL (benchmarks/NOTES.md).
        grpo=GRPOSection(prompts_per_step=16, num_generations=8, eps_low=0.2, beta=0.0,
                         teacher_model_name_or_path="runs/arith_cpu/hf", teacher_tau=1.0, loss_top_k=4),
        optim=OptimSection(learning_rate=2e-4, b2=0.99, max_grad_norm=1.0, weight_decay=0.0),
        sft=SFTSection(steps=400, batch_size=128, learning_rate=1e-3, target_accuracy=0.25, eval_every=10,
                       eval_size=256),
        eval=EvalSection(every=50, num_questions=200, num_samples=8, ks=(1, 8), temperature=1.0, greedy=True),
        train=TrainSection(steps=300, seed=1, run_dir="runs/arith_cpu_distill", samples_every=100,
                           checkpoint_every=100, keep_checkpoints=2),
    )
