"""Rollout seconds for the same rows on one device and on 8 (fake CPU) devices.

    .venv/bin/python benchmarks/bench_rollout_devices.py [--repeats 5] [--prompts 4 16]

W1's model (grpo_jax/cli/bench.py: hidden 256, MLP 704, 4 layers, vocab 1024, float32) samples G=8
answers of exactly 64 tokens (ignore_eos) to N random 29-token prompts (bucket 32), N = 4 (W1) and
16. Each layout runs in its own process, the 8-device ones with
XLA_FLAGS=--xla_force_host_platform_device_count=8:

    1dev_threads1    one device, a 1-device mesh (as the trainer builds it), 1 sampler thread
    1dev_threads2    the same with 2 threads (train._auto_sampler_threads' default on 2 cores)
    data8            mesh data=8: rows over 8 devices
    fsdp8            mesh fsdp=8, params passed in the training layout (the per-call gather counts)
    replicated_data8 the old layout on data=8 (no Sampler mesh: every device decodes every row)

Figures: median of `--repeats` calls after one warm-up call (compile). 8 fake devices share the
machine's cores, so the 8-device time approaches the 1-device time only if each device does 1/8
of the rows. Prints one JSON line, with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LAYOUTS = {"1dev_threads1": (1, None, 1), "1dev_threads2": (1, None, 2), "data8": (8, (8, 1, 1), 1),
           "fsdp8": (8, (1, 8, 1), 1), "replicated_data8": (8, (8, 1, 1), 1)}
GROUP, NEW_TOKENS, PROMPT_TOKENS = 8, 64, 29


def child(layout: str, num_prompts: int, repeats: int) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from grpo_jax.distributed import sharding
    from grpo_jax.cli.bench import W1_MODEL
    from grpo_jax.model import ModelConfig, init_model
    from grpo_jax.sampling.sampler import Sampler, SamplingConfig

    m = W1_MODEL
    config = ModelConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                         num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
                         head_dim=m.head_dim, rope_theta=m.rope_theta, qkv_bias=m.qkv_bias,
                         tie_embeddings=m.tie_embeddings, dtype=m.dtype, param_dtype="float32")
    _, mesh_shape, threads = LAYOUTS[layout]
    mesh = sharding.make_mesh(*(mesh_shape or (1, 1, 1)))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: init_model(config, 0)))
    params = jax.jit(lambda: nnx.split(init_model(config, 0))[1])()
    params = jax.device_put(params, sharding.param_shardings(mesh, params))  # the training layout
    sampler = Sampler(graphdef, config, eos_id=1, pad_id=0, threads=threads,
                      mesh=None if layout.startswith("replicated") else mesh)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, config.vocab_size, PROMPT_TOKENS).tolist() for _ in range(num_prompts)]
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True)

    def run(seed):
        out = sampler(params, prompts, num_samples=GROUP, sampling=sampling, rng=jax.random.PRNGKey(seed))
        jax.block_until_ready(out.tokens_BxC)
        return out

    start = time.perf_counter()
    out = run(0)
    first = time.perf_counter() - start
    times = []
    for seed in range(1, repeats + 1):
        start = time.perf_counter()
        run(seed)
        times.append(time.perf_counter() - start)
    return {"median_s": round(statistics.median(times), 4), "min_s": round(min(times), 4),
            "compile_s": round(first - statistics.median(times), 2), "rows": int(out.tokens_BxC.shape[0]),
            "devices": jax.device_count()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, nargs="*", default=[4, 16])
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    parser.add_argument("--child", nargs=2, metavar=("LAYOUT", "PROMPTS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.repeats)))
        return 0
    result: dict = {"bench": "rollout_devices", "group": GROUP, "new_tokens": NEW_TOKENS,
                    "load_before": [round(x, 2) for x in os.getloadavg()], "figures": {}}
    for n in args.prompts:
        figures = {}
        for layout in args.layouts:
            devices = LAYOUTS[layout][0]
            env = dict(os.environ, JAX_PLATFORMS="cpu")
            env.pop("XLA_FLAGS", None)
            if devices > 1:
                env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
            proc = subprocess.run([sys.executable, __file__, "--child", layout, str(n), "--repeats", str(args.repeats)],
                                  env=env, capture_output=True, text=True, timeout=1800)
            if proc.returncode:
                raise SystemExit(f"{layout} x {n} prompts failed:\n{proc.stderr[-4000:]}")
            figures[layout] = json.loads(proc.stdout.strip().splitlines()[-1])
        for name in ("data8", "fsdp8", "replicated_data8"):
            for base in ("1dev_threads1", "1dev_threads2"):
                if name in figures and base in figures:
                    figures[name][f"vs_{base}"] = round(figures[name]["median_s"] / figures[base]["median_s"], 2)
        result["figures"][f"{n}x{GROUP}x{NEW_TOKENS}"] = figures
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
