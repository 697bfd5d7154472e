"""Sampler throughput: compile time, rollout time (median), generated tokens/s.

    .venv/bin/python benchmarks/bench_sampler.py [--repeats 5]

Workload W1 (CPU and GPU): hidden 256, MLP 704, 4 layers, 4 heads, 2 KV heads, head_dim 64,
vocab 1024, float32, qkv_bias, untied; 4 prompts x G=8 = 32 sequences x 64 new tokens from
32-token prompts, ignore_eos. With a GPU also a random Qwen2-0.5B-shaped model in bfloat16.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

from grpo_jax.model import ModelConfig, init_model
from grpo_jax.sampling.sampler import Sampler, SamplingConfig

W1 = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=4,
                 num_kv_heads=2, head_dim=64, qkv_bias=True)
QWEN2_05B = ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                        num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1e6, qkv_bias=True,
                        tie_embeddings=True, param_dtype="bfloat16", dtype="bfloat16")


def bench(name: str, config: ModelConfig, *, num_prompts: int, group: int, prompt_len: int,
          new_tokens: int, repeats: int) -> dict:
    graphdef, params = nnx.split(init_model(config, 0), nnx.Param)
    sampler = Sampler(graphdef, config, eos_id=1, pad_id=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, config.vocab_size, prompt_len).tolist() for _ in range(num_prompts)]
    sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)

    def run(seed):
        out = sampler(params, prompts, num_samples=group, sampling=sampling, rng=jax.random.key(seed))
        jax.block_until_ready(out.tokens_BxC)
        return out

    start = time.perf_counter()
    run(0)
    first = time.perf_counter() - start
    times = []
    for seed in range(1, repeats + 1):
        start = time.perf_counter()
        out = run(seed)
        times.append(time.perf_counter() - start)
    rollout = statistics.median(times)
    generated = int(out.mask_BxC.sum())
    result = dict(name=name, compile_s=first - rollout, rollout_s=rollout, tokens=generated,
                  tokens_per_s=generated / rollout, backend=jax.default_backend())
    print(f"{name} [{result['backend']}]: compile {result['compile_s']:.2f} s, rollout median "
          f"{rollout * 1e3:.1f} ms over {repeats} (min {min(times) * 1e3:.1f}), "
          f"{generated} tokens ({num_prompts}x{group} x {new_tokens}), {result['tokens_per_s']:.0f} tokens/s")
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    bench("W1 tiny float32", W1, num_prompts=4, group=8, prompt_len=32, new_tokens=64,
          repeats=args.repeats)
    if jax.default_backend() == "gpu":
        bench("Qwen2-0.5B-shaped bf16", QWEN2_05B, num_prompts=4, group=8, prompt_len=32,
              new_tokens=64, repeats=args.repeats)


if __name__ == "__main__":
    main()
