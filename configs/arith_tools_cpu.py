"""python -m grpo_jax train --config configs/arith_tools_cpu.py

The multi-turn CPU demo: 2-digit products ("37*48=") with a calculator the model calls by answering
"?" (grpo_jax.tasks.tool_products). The calculator replies "1776=" and the model's next turn is its
answer, scored by exact match. The arithmetic demo's model (2 layers, width 128, ~0.4M parameters)
cannot multiply, so the tool is what makes the task solvable; `--set task.options.tool=false` runs
the same budget with the calculator unavailable (benchmarks/bench_tool_demo.py runs both).

SFT warm-up (the task's `warmup_example`): half calls ("37*48=" -> "?"), half reading a reply
("37*48=?1776=" -> "1776"), stopped once greedy validation reaches `sft.target_accuracy`, so GRPO has
reading the calculator inside real episodes left to learn. GRPO settings are the arithmetic demo's.
Measured (benchmarks/bench_tool_demo.py, seeds 1/2/3, shared 2-core machine): held-out greedy success
0.11/0.25/0.02 -> 1.00/1.00/0.845 in 300 steps, 1.6-3.6 minutes in all; without the calculator the
same budget ends at 0.125/0.075/0.11.
"""

from grpo_jax.config import (Config, EvalSection, GRPOSection, ModelSection, OptimSection, SamplingSection,
                             SFTSection, TaskSection, TrainSection)


def get_config() -> Config:
    return Config(
        model=ModelSection(tokenizer="char:0123456789*=?", hidden_size=128, intermediate_size=512,
                           num_layers=2, num_heads=4, num_kv_heads=4, head_dim=32, init_seed=1),
        # Two model turns: the call ("?" and its stop token) and the answer (4 digits and the stop
        # token at most). The budget counts the calculator's reply too: 2 + 5 ("9801=") + 5 = 12.
        task=TaskSection(name="tool_products", options={"digits": 2, "tool": True, "seed": 1},
                         max_turns=2, max_tokens_per_turn=5),
        sampling=SamplingSection(max_new_tokens=12, temperature=1.0),
        grpo=GRPOSection(prompts_per_step=16, num_generations=8, eps_low=0.2, beta=0.0),
        optim=OptimSection(learning_rate=2e-4, b2=0.99, max_grad_norm=1.0, weight_decay=0.0),
        sft=SFTSection(steps=400, batch_size=128, learning_rate=1e-3, target_accuracy=0.6, eval_every=10,
                       eval_size=256),
        eval=EvalSection(every=50, num_questions=200, num_samples=4, ks=(1, 4), temperature=1.0, greedy=True),
        train=TrainSection(steps=300, seed=1, run_dir="runs/arith_tools_cpu", samples_every=100,
                           checkpoint_every=0, keep_checkpoints=1),
    )
