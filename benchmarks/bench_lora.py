"""LoRA on W1's model: how the sampler should apply the adapters, and what LoRA does to a step.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_lora.py [--out F] [--rank 16]

1. Sampler, merged vs on the fly. Merged: one `lora.merge` per rollout, then decode from plain
   weights (what grpo_jax does). On the fly: every decode step computes x @ W + s * (x @ A) @ B for
   each targeted weight. Timed as a jitted loop of `max_new_tokens` steps over W1's targeted
   matrices at the decode batch (32 rows, one token each): the part of a decode step that differs
   between the two; plus the merge itself.
2. A W1 step (`train.run`, steps 3..N median) with full fine-tuning and with rank-r adapters on
   every linear layer: time per step and phase, and trainable parameter counts.
Writes benchmarks/results/lora.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.cli import bench
from grpo_jax.model import lora
from grpo_jax.training import train
from grpo_jax import model as model_lib
from grpo_jax.io.tokenizer import load_tokenizer


def _time(fn, *args, repeats: int = 20) -> float:
    """Median seconds of `fn(*args)` (compiled first), waiting for its result each time."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sampler_ways(rank: int, rows: int, steps: int) -> dict:
    config = bench.W1_MODEL.model_config(bench.W1_MODEL.vocab_size)
    _, base = nnx.split(model_lib.init_model(config, 0))
    targets = lora.resolve_targets(["all-linear"])
    adapters = lora.init_adapters(base, targets, rank, jax.random.PRNGKey(1))
    adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # B != 0, as after training
    scale = 2.0
    merge = jax.jit(lambda ad, b: lora.merge(b, ad, scale))
    pairs = [(names, shape) for names, shape in lora.targeted(base, targets)]

    def matrices(params):
        flat = {lora._names(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
        return [flat[names].reshape(lora._split(shape, names[-1])) for names, shape in pairs]

    def adapter_pairs(ad):
        return [(lora._lookup(ad, names)["lora_a"], lora._lookup(ad, names)["lora_b"]) for names, _ in pairs]

    x0 = jax.random.normal(jax.random.PRNGKey(2), (rows, max(m.shape[0] for m in matrices(base))))

    def decode_merged(ws, x):
        def body(_, x):
            out = sum(jnp.sum(x[:, : w.shape[0]] @ w) for w in ws)
            return x + 1e-6 * out
        return jax.lax.fori_loop(0, steps, body, x)

    def decode_on_the_fly(ws, abs_, x):
        def body(_, x):
            out = sum(jnp.sum(x[:, : w.shape[0]] @ w + scale * ((x[:, : w.shape[0]] @ a) @ b))
                      for w, (a, b) in zip(ws, abs_))
            return x + 1e-6 * out
        return jax.lax.fori_loop(0, steps, body, x)

    merged_ws = matrices(merge(adapters, base))
    return {
        "rows": rows, "steps": steps, "rank": rank, "targeted_matrices": len(pairs),
        "merge_s": _time(merge, adapters, base),
        "decode_linear_merged_s": _time(jax.jit(decode_merged), merged_ws, x0),
        "decode_linear_on_the_fly_s": _time(jax.jit(decode_on_the_fly), matrices(base), adapter_pairs(adapters), x0),
    }


def w1_steps(rank: int, steps: int) -> dict:
    out = {}
    for name, r in (("full", 0), (f"lora r={rank}", rank)):
        with tempfile.TemporaryDirectory(prefix="grpo_jax_bench_lora_") as run_dir:
            cfg = bench.w1_config(run_dir, steps=steps)
            cfg = dataclasses.replace(cfg,
                                      lora=dataclasses.replace(cfg.lora, r=r))
            tokenizer = bench.WideVocabTokenizer(load_tokenizer(cfg.model.tokenizer_spec()))
            result = train.run(cfg, task=bench.AdditionTask(), tokenizer=tokenizer)
        rows = result.history[2:]
        out[name] = {k: statistics.median(row[f"time/{k}"] for row in rows)
                     for k in ("step", "rollout", "logprobs", "update")}
        out[name]["trainable_params"] = lora.count(result.params)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/lora.json")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    ways = sampler_ways(args.rank, rows=32, steps=64)
    print(f"sampler, {ways['targeted_matrices']} matrices, rank {args.rank}, 32 rows x 64 tokens: merge once "
          f"{ways['merge_s'] * 1e3:.2f} ms; targeted matmuls merged {ways['decode_linear_merged_s'] * 1e3:.2f} ms vs "
          f"on the fly {ways['decode_linear_on_the_fly_s'] * 1e3:.2f} ms per rollout")
    w1 = w1_steps(args.rank, args.steps)
    for name, r in w1.items():
        print(f"W1 {name:10s}: step {r['step']:.3f} s (rollout {r['rollout']:.3f}, logprobs {r['logprobs']:.3f}, "
              f"update {r['update']:.3f}); {r['trainable_params']:,} trainable params")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"sampler": ways, "w1": w1, "when": time.strftime("%Y-%m-%d %H:%M:%S")}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
