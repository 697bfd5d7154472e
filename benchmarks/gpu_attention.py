"""The attention kernels at reasoning lengths on this machine's accelerator (or a CPU, smaller):
forward + backward seconds and the compiled program's temporaries for each kernel that runs here,
one row of Qwen2.5-0.5B's heads (14 query, 2 kv, head_dim 64) in bf16. Prints one JSON line.

    python benchmarks/gpu_attention.py [--lengths 2048 8192 32768] [--kernels xla blockwise cudnn]

The reference kernel ("xla") is skipped where its [T, T] scores alone exceed --xla-max-gib.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp


def measure(kernel: str, length: int, repeats: int) -> dict:
    from grpo_jax.model import attention

    shape_q, shape_kv = (1, length, 14, 64), (1, length, 2, 64)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], shape_q, jnp.bfloat16)
    k = jax.random.normal(keys[1], shape_kv, jnp.bfloat16)
    v = jax.random.normal(keys[2], shape_kv, jnp.bfloat16)
    valid = jnp.ones((1, length), jnp.int32).at[:, :37].set(0)  # a left-padded prompt

    def loss(q, k, v):
        return jnp.sum(attention.self_attention(q, k, v, valid, impl=kernel).astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
    compiled = step.lower(q, k, v).compile()
    jax.block_until_ready(step(q, k, v))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(q, k, v))
        times.append(time.perf_counter() - start)
    ran = attention.resolve(kernel, dtype=jnp.bfloat16, head_dim=64, score_bytes=4 * 14 * length * length)
    return {"kernel": kernel, "ran": ran, "length": length, "fwd_bwd_ms": round(1e3 * min(times), 2),
            "temp_mib": round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[2048, 8192, 32768])
    parser.add_argument("--kernels", nargs="*", default=["xla", "blockwise", "cudnn"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--xla-max-gib", type=float, default=16.0)
    args = parser.parse_args()
    rows = []
    for length in args.lengths:
        for kernel in args.kernels:
            if kernel == "xla" and 4 * 14 * length * length / 2**30 > args.xla_max_gib:
                rows.append({"kernel": kernel, "length": length, "skipped": "scores exceed --xla-max-gib"})
                continue
            try:
                rows.append(measure(kernel, length, args.repeats))
            except Exception as e:  # noqa: BLE001 - a kernel that cannot run here is a figure too
                rows.append({"kernel": kernel, "length": length, "error": f"{type(e).__name__}: {e}"[:300]})
    print(json.dumps({"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "rows": rows}))


if __name__ == "__main__":
    main()
