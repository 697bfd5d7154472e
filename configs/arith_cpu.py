"""python -m grpo_jax train --config configs/arith_cpu.py

The CPU demo: SFT warm-up then GRPO on 2-digit addition, answers written least-significant digit first.
A 2-layer, width-128 decoder (~0.4M parameters) over a 14-symbol vocabulary. SFT stops once greedy
validation accuracy reaches 0.25, so GRPO (verifier reward only, no labels) has the rest to learn.
Settings from ../shared/DEMO_NOTES.md: 16 prompts x G=8, temperature 1, AdamW lr 2e-4 (b2 0.99),
clip-norm 1, eps 0.2, beta 0. Reversed answer digits make this reliably learnable for a tiny model.
Measured here: greedy held-out accuracy 0.285 -> 0.955 in 1,000 steps, 4.5 minutes in all.
"""

from grpo_jax.config import (Config, EvalSection, GRPOSection, ModelSection, OptimSection, SamplingSection,
                               SFTSection, TaskSection, TrainSection)


def get_config() -> Config:
    return Config(
        model=ModelSection(tokenizer="char:0123456789+=", hidden_size=128, intermediate_size=512,
                           num_layers=2, num_heads=4, num_kv_heads=4, head_dim=32, init_seed=1),
        task=TaskSection(name="arithmetic", options={"digits": 2, "operators": "+", "reverse_answer": True,
                                                     "template": "compact", "seed": 1}),
        sampling=SamplingSection(max_new_tokens=5, temperature=1.0),
        grpo=GRPOSection(prompts_per_step=16, num_generations=8, eps_low=0.2, beta=0.0),
        optim=OptimSection(learning_rate=2e-4, b2=0.99, max_grad_norm=1.0, weight_decay=0.0),
        sft=SFTSection(steps=400, batch_size=128, learning_rate=1e-3, target_accuracy=0.25, eval_every=10,
                       eval_size=256),
        eval=EvalSection(every=100, num_questions=200, num_samples=8, ks=(1, 8), temperature=1.0, greedy=True),
        train=TrainSection(steps=1000, seed=1, run_dir="runs/arith_cpu", samples_every=100,
                           checkpoint_every=100, keep_checkpoints=2),
    )
