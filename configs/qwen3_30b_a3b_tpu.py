"""python -m grpo_jax train --config configs/qwen3_30b_a3b_tpu.py --set model.hf_path=/mnt/models/Qwen3-30B-A3B --set task.options.path=/mnt/data/gsm8k_train.jsonl

GRPO, every weight trained, on Qwen3-30B-A3B (30.5B parameters, 3.3B active per token: 48 sparse
layers of 128 experts, 8 per token) on a TPU v5p-64 slice (64 chips, 95 GiB HBM each), with
completions up to 8,192 tokens. Before renting the slice:

    python -m grpo_jax check --config configs/qwen3_30b_a3b_tpu.py --model-shape qwen3-30b-a3b \\
        --devices 64 --memory-per-device 95GiB

fsdp=16 splits every matrix's hidden dimension and the rows; tensor=4 splits the heads (32 query,
4 KV: one KV head per chip, so each chip caches a quarter of the KV), the vocabulary and the
experts (32 of the 128 on each chip). The float32 masters, Adam's two moments and the gradients
(16 B a parameter, 488 GB in all) take 7.6 GB a chip; the sampler's bf16 copy, whole along fsdp,
another 15 GB. 64 prompts x 16 completions = 1,024 rows: 64 a chip in the rollout; the update
takes one row a chip per micro-batch (4 minibatches x 16 micro-batches). Run the same command on
every worker of the slice (launch/tpu_pod.sh).

Does not fit yet at 8,192 new tokens. `check` (compiled on 64 fake CPU devices, 10-12 minutes)
puts the update at 938 GiB a chip: each sparse layer sorts the (token, choice) pairs of the
whole micro-batch, so the partitioner gathers all 16 row devices' tokens onto every chip ("MoE
pairs/layer", 5.8 GiB in bf16), and the compiled update keeps about 19 GiB more per layer.
Splitting the experts' dispatch per device (an expert mesh axis with an all-to-all) removes the
16x; until then the state figures (7.1 GiB a chip) are the ones to trust.
"""

from grpo_jax.config import (Config, EvalSection, GRPOSection, MeshSection, ModelSection, OptimSection,
                             RewardsSection, SamplingSection, TaskSection, TrainSection)


def get_config() -> Config:
    return Config(
        model=ModelSection(hf_path="/mnt/models/Qwen3-30B-A3B", dtype="bfloat16", remat=True),
        mesh=MeshSection(data=1, fsdp=-1, tensor=4),
        task=TaskSection(name="jsonl", options={"path": "/mnt/data/gsm8k_train.jsonl", "template": "r1",
                                                "answer_format": "gsm8k", "format_weight": 0.2, "chat": True}),
        sampling=SamplingSection(max_new_tokens=8192, temperature=1.0),
        grpo=GRPOSection(prompts_per_step=64, num_generations=16, eps_low=0.2, eps_high=0.28, beta=0.0,
                         aggregation="token", num_iterations=1, num_minibatches=4, grad_accum_steps=16,
                         dynamic_sampling=True, mask_truncated_completions=True,
                         # Each completion runs its own prompt: a shared-prompt chunk of the log-prob
                         # pass would be whole groups on each of the 16 row devices (256 rows), and
                         # each sparse layer gathers a pass's pairs from every row device (check's
                         # "MoE pairs/layer"): 88 GiB a chip in that layout, 5.8 GiB in this one.
                         share_prompt_prefix=False),
        optim=OptimSection(learning_rate=1e-6, schedule="cosine", warmup_steps=20, b2=0.99,
                           weight_decay=0.01, max_grad_norm=1.0),
        eval=EvalSection(every=50, num_questions=512, num_samples=8, ks=(1, 8)),
        train=TrainSection(steps=1000, seed=0, run_dir="gs://YOUR_BUCKET/grpo_jax/qwen3_30b_a3b", samples_every=10,
                           checkpoint_every=25, keep_checkpoints=3, export_hf=True),
        rewards=RewardsSection(workers=8),
    )
