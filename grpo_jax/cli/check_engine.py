"""`check` with sampling.engine="vllm": what a colocated vLLM engine takes of each device, what it
leaves the trainer, and whether its share holds the engine at all.

A colocated engine (sampling.vllm_mode="colocate") runs on the trainer's devices and takes
`sampling.vllm_gpu_memory_utilization` of each device's memory (its weights, its KV cache, its
activations). JAX gets XLA_PYTHON_CLIENT_MEM_FRACTION of the device: `python -m grpo_jax train`
sets it to 0.95 - utilization (at least 0.05) unless the user set it (`jax_memory_fraction`,
the same rule as grpo_jax.__main__._share_memory_with_vllm); the 5% between them is both runtimes'
own overhead. So the update's peak is judged against that fraction of the device, not the device.
Sleep mode frees the engine's memory during the update, but JAX's pool was capped at start-up, so
the cap holds either way. A server engine (vllm_mode="server") runs on devices of its own: it
takes nothing here and JAX's default pool applies.

The engine's share must at least hold its weights and one max-length sequence's KV cache
(`engine_needs`), or vLLM refuses to start ("no space for KV cache"). That is a lower bound:
vLLM also profiles its activations and wants room for many sequences to be fast.
"""

from __future__ import annotations

import math
import os
from typing import Mapping

FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_DEFAULT_FRACTION = 0.75  # JAX's GPU pool without XLA_PYTHON_CLIENT_MEM_FRACTION


def colocated(config) -> bool:
    s = config.sampling
    return s.engine == "vllm" and s.vllm_mode == "colocate"


def jax_memory_fraction(config, environ: Mapping[str, str] = os.environ) -> float | None:
    """The share of each device JAX gets beside a colocated engine: the user's
    XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.95 - utilization (at least 0.05). None without one."""
    if not colocated(config):
        return None
    if FRACTION_ENV in environ:
        return float(environ[FRACTION_ENV])
    # Rounded as train writes it into the environment (two decimals).
    return round(max(0.05, 0.95 - config.sampling.vllm_gpu_memory_utilization), 2)


def engine_needs(config, model_config, *, prompt_len: int) -> dict:
    """Bytes per device the engine needs at the least: its weights in its dtype, plus one
    max-length sequence's KV cache, with tensor parallelism splitting both over its devices.

        weights  = (parameters of the HF checkpoint, tied embeddings once) * bytes / tp
        kv_cache = 2 (K and V) * layers * kv_heads_per_device * head_dim * bytes * sequence
        sequence = sampling.vllm_max_model_length, or (max prompt bucket + max_new_tokens)

    kv_heads_per_device = kv_heads / tp, and 1 where tp > kv_heads (vLLM then replicates the heads).
    """
    from grpo_jax.io import hf
    from grpo_jax.sampling import vllm_setup

    s = config.sampling
    dtype = vllm_setup.engine_dtype(config)
    item = {"float32": 4, "bfloat16": 2}[dtype]
    tp = s.vllm_tensor_parallel_size
    params = sum(math.prod(e.hf_shape) for e in hf.weight_map(model_config))
    sequence = s.vllm_max_model_length or prompt_len + s.max_new_tokens
    kv_heads = max(1, model_config.num_kv_heads // tp)
    weights = math.ceil(params * item / tp)
    kv = 2 * model_config.num_layers * kv_heads * model_config.head_dim * item * sequence
    return {"dtype": dtype, "tensor_parallel_size": tp, "params": params, "sequence_tokens": sequence,
            "weights_bytes": weights, "kv_cache_bytes": kv, "needs_bytes": weights + kv}


def whole_device(pool_bytes: int | None, backend: str, environ: Mapping[str, str] = os.environ) -> int | None:
    """The device's memory from JAX's own pool limit (what `check` reads without --memory-per-device):
    on a GPU the pool is XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) of the card; elsewhere the
    limit is the device's."""
    if pool_bytes is None or backend not in ("gpu", "cuda", "rocm"):
        return pool_bytes
    return int(pool_bytes / float(environ.get(FRACTION_ENV, JAX_DEFAULT_FRACTION)))


def engine_share(config, model_config, *, device_bytes: int | None, prompt_len: int,
                 environ: Mapping[str, str] = os.environ) -> dict | None:
    """The engine's figures for `check` (None when the rollout runs on our own sampler):
    `engine_bytes` it takes of each device, `jax_bytes` left for the trainer (what the update's
    peak is judged against), what it needs at the least, and `engine_fits` (None: no device size)."""
    s = config.sampling
    if s.engine != "vllm":
        return None
    if s.vllm_mode == "server":
        return {"mode": "server", "engine_bytes": 0, "jax_fraction": None, "jax_bytes": device_bytes,
                "engine_fits": None, "needs": None,
                "where": f"a server at {s.vllm_server_host}:{s.vllm_server_port} on devices of its own"}
    fraction = jax_memory_fraction(config, environ)
    needs = engine_needs(config, model_config, prompt_len=prompt_len)
    engine = None if device_bytes is None else int(s.vllm_gpu_memory_utilization * device_bytes)
    return {"mode": "colocate", "utilization": s.vllm_gpu_memory_utilization, "engine_bytes": engine,
            "jax_fraction": fraction, "jax_bytes": None if device_bytes is None else int(fraction * device_bytes),
            "needs": needs, "engine_fits": None if engine is None else engine >= needs["needs_bytes"],
            "where": "in this process, on the trainer's devices"}
