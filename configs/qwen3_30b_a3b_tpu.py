"""python -m grpo_jax train --config configs/qwen3_30b_a3b_tpu.py --set model.hf_path=/mnt/models/Qwen3-30B-A3B --set task.options.path=/mnt/data/gsm8k_train.jsonl

GRPO, every weight trained, on Qwen3-30B-A3B (30.5B parameters, 3.3B active per token: 48 sparse
layers of 128 experts, 8 per token) on a TPU v5p-64 slice (64 chips, 95 GiB HBM each), with
completions up to 8,192 tokens. Before renting the slice:

    python -m grpo_jax check --config configs/qwen3_30b_a3b_tpu.py --model-shape qwen3-30b-a3b \\
        --devices 64 --memory-per-device 95GiB

fsdp=16 splits every matrix's hidden dimension and the rows; tensor=4 splits the heads (32 query,
4 KV: one KV head per chip, so each chip caches a quarter of the KV), the vocabulary and each
expert's width (192 of 768). `mesh.expert` is left at 1: an expert group all-gathers its tokens, so
with one 8,704-token row a chip per micro-batch, expert=8 (fsdp=8) measured 29 GiB a sparse layer
in the update against 3.8 here. The float32 masters, Adam's two moments and the gradients
(16 B a parameter, 488 GB in all) take 7.6 GB a chip; the sampler's bf16 copy, whole along fsdp,
another 15 GB. 64 prompts x 16 completions = 1,024 rows: 64 a chip in the rollout; the update
takes one row a chip per micro-batch (4 minibatches x 16 micro-batches). Run the same command on
every worker of the slice (launch/tpu_pod.sh).

Measured by `check` (compiled on 64 fake CPU devices, 5 minutes), per chip: state 7.1 GiB;
rollout 58 GiB (prefill 9.4 GiB of scratch, decode 35 GiB), log-prob pass 67 GiB, update 215 GiB,
so over 95 GiB in the update at 8,192 new tokens. Each device routes its own tokens
(`grpo_jax.model.expert_dispatch`): the update was 938 GiB when every chip sorted the whole
micro-batch's (token, choice) pairs. What is left is a CPU compile's: JAX saves only each layer's
input for the backward (remat; `jax.ad_checkpoint.print_saved_residuals`), but XLA:CPU keeps the
tiled grouped matmul's intermediates of every sparse layer until its backward (3.8 GiB a layer
here; a 4-layer probe keeps 118 MiB a layer with the tiled form, 20 with `ragged_dot`, 16 for a
dense MLP). A TPU runs `ragged_dot`; its own compile is the figure to trust, and none was at hand.
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
