"""grpo_jax: python grpo_jax_grpo.py MODEL_DIR"""

import sys

from grpo_jax.training import train
from grpo_jax.config import (Config, EvalSection, GRPOSection, ModelSection, OptimSection, RewardsSection,
                             SamplingSection, TaskSection, TrainSection)

model = sys.argv[1]
config = Config(
    model=ModelSection(hf_path=model),
    task=TaskSection(name="jsonl", options={"path": "data.jsonl"}),
    grpo=GRPOSection(prompts_per_step=2, num_generations=4, beta=0.0),
    sampling=SamplingSection(max_new_tokens=16, temperature=1.0),
    optim=OptimSection(learning_rate=1e-5),
    eval=EvalSection(num_questions=0),
    train=TrainSection(steps=4, run_dir="runs/grpo_jax", log_every=1, progress=False, report_to=()),
    rewards=RewardsSection(reward_funcs=("rewards:correct", "rewards:brevity"), reward_weights=(1.0, 0.1)),
)
train.run(config, overwrite=True)
