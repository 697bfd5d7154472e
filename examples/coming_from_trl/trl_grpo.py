"""TRL: python trl_grpo.py MODEL_DIR   (torch, transformers and trl installed)"""

import sys

from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

from rewards import brevity, correct

model = sys.argv[1]
data = load_dataset("json", data_files="data.jsonl", split="train")
args = GRPOConfig(
    output_dir="runs/trl",
    max_steps=4,
    per_device_train_batch_size=8,   # completions per step: 2 prompts x 4 generations
    num_generations=4,
    max_completion_length=16,
    temperature=1.0,
    learning_rate=1e-5,
    beta=0.0,
    reward_weights=[1.0, 0.1],
    logging_steps=1,
    report_to=[],
    use_cpu=True,
)
trainer = GRPOTrainer(model=model, reward_funcs=[correct, brevity], args=args, train_dataset=data)
trainer.train()
