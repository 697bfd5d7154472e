"""Decoder-only transformer (Llama / Qwen2 / Qwen3 / Qwen3-MoE / Gemma 3 text) in Flax NNX, used functionally.

One config covers RMSNorm, RoPE (theta, optional Llama-3 scaling), grouped-query attention, a
SwiGLU MLP, optional q/k/v bias (Qwen2), optional q/k RMSNorm over head_dim (Qwen3), tied or
untied embeddings, and top-k routed experts in place of the MLP in chosen layers (Qwen3-MoE).
Code that jits takes `graphdef, params = nnx.split(model, nnx.Param)` and calls the pure
`token_logprobs`; nothing here uses `nnx.jit`.

One module per job:

    config.py        ModelConfig, RopeScaling, the dtype names
    partitioning.py  SHARDING (weight name -> PartitionSpec) and partition_specs
    rope.py          rotary embedding: frequencies, cos/sin tables, rotation
    kernels.py       rms_norm, and dense / swiglu with their custom VJPs
    attention.py     KVCache and the three attention kernels (full, one query, shared prompt)
    transformer.py   the NNX modules, init_model, default_positions; the parameter tree
    moe.py           the sparse feed-forward: routing, experts, load-balancing loss, routing replay
    grouped_matmul.py  the experts' matmul over expert-sorted rows (ragged_dot, or tiled)
    expert_dispatch.py a sparse layer on a mesh: each device's tokens, experts over the expert axis
    logprobs.py      token_logprobs

Dimension letters: B batch, T query length, S key length / sequence, D hidden_size, N num_heads,
K num_kv_heads, G = N // K query heads per kv head, H head_dim, F intermediate_size, V vocab,
C number of target tokens, L layers. In moe.py (no kv heads there): E experts, K experts per
token, I moe_intermediate_size.
"""

from grpo_jax.model.attention import KVCache
from grpo_jax.model.config import ModelConfig, RopeScaling
from grpo_jax.model.kernels import dense, rms_norm, swiglu
from grpo_jax.model.logprobs import token_logprobs
from grpo_jax.model.partitioning import SHARDING, partition_specs
from grpo_jax.model.rope import Rope, apply_rope, rope_inv_freq, rope_tables
from grpo_jax.model.transformer import Transformer, default_positions, init_model

__all__ = [
    "SHARDING",
    "KVCache",
    "ModelConfig",
    "Rope",
    "RopeScaling",
    "Transformer",
    "apply_rope",
    "default_positions",
    "dense",
    "init_model",
    "partition_specs",
    "rms_norm",
    "rope_inv_freq",
    "rope_tables",
    "swiglu",
    "token_logprobs",
]
