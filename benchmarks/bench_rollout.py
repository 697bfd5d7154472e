"""W3: rollouts of long-tailed lengths through the static and the continuous engine, and the full
GRPO step with and without length bucketing. Prints one JSON line.

    .venv/bin/python benchmarks/bench_rollout.py --workload w3 [--repeats 3] [--steps 4]

W3 (issue 15): W1's model (grpo_jax/cli/bench.py: Qwen2-shaped, 4 layers, hidden 256, vocab 1024, fp32),
16 random 29-token prompts (bucket 32) x G=8 = 128 completions, max_new_tokens=512, temperature 1.
Row r stops after `bench.w3_completion_lengths()[r]` tokens (min(512, ceil(exp(log 96 + 0.9 z_r))),
seed 0), forced by masking every logit but EOS at that step and EOS before it (`forced_lengths`),
the same rows for every engine. Each configuration runs in its own process (peak RSS is the
process's); figures are the median of `--repeats` calls after one warm-up call, whose extra time
is reported as compile time. Steps: `train.run` on the same rows (beta 0.04, one update per batch),
median of steps 2..N. Run on a quiet machine, under `flock /tmp/bench.lock` when others benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

NUM_PROMPTS, GROUP, PROMPT_TOKENS = 16, 8, 29


def _model():
    from grpo_jax.cli.bench import W1_MODEL
    from grpo_jax.model import ModelConfig

    m = W1_MODEL
    return ModelConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                       num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
                       head_dim=m.head_dim, rope_theta=m.rope_theta, qkv_bias=m.qkv_bias,
                       tie_embeddings=m.tie_embeddings, dtype=m.dtype, param_dtype="float32")


def rollout_child(engine: str, threads: int, slots: int, refill_every: int, repeats: int, tokens_out: str) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from grpo_jax.cli import bench
    from grpo_jax.distributed import sharding
    from grpo_jax.model import init_model
    from grpo_jax.sampling.sampler import Sampler, SamplingConfig

    config = _model()
    mesh = sharding.make_mesh(1, 1, 1)  # as the trainer builds it on one device
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: init_model(config, 0)))
    params = jax.jit(lambda: nnx.split(init_model(config, 0))[1])()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, config.vocab_size, PROMPT_TOKENS).tolist() for _ in range(NUM_PROMPTS)]
    lengths = bench.w3_completion_lengths(NUM_PROMPTS * GROUP)
    sampling = SamplingConfig(max_new_tokens=bench.W3_MAX_NEW_TOKENS, temperature=1.0)
    sampler = Sampler(graphdef, config, eos_id=1, pad_id=0, threads=threads, mesh=mesh, engine=engine,
                      decode_slots=slots, refill_every=refill_every)

    def run(seed):
        out = sampler(params, prompts, num_samples=GROUP, sampling=sampling, rng=jax.random.key(seed),
                      forced_lengths=lengths)
        return jax.block_until_ready(out)

    out, first, times = timed_calls(run, lengths, repeats)
    np.save(tokens_out, np.asarray(out.tokens_BxC))
    prefill, decode = sampler.lower(params, prompts, num_samples=GROUP, sampling=sampling, rng=jax.random.key(0))
    programs = {}
    for name, lowered in (("prefill", prefill), ("decode", decode)):
        mem = lowered.compile().memory_analysis()
        programs[name] = int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                             - mem.alias_size_in_bytes)
    median = statistics.median(times)
    real = int(lengths.sum())
    return {"engine": engine, "threads": threads, "slots": sampler.slots_per_device(NUM_PROMPTS * GROUP // threads)
            if engine == "continuous" else None, "refill_every": refill_every if engine == "continuous" else None,
            "median_s": round(median, 3), "min_s": round(min(times), 3), "compile_s": round(first - median, 2),
            "real_tokens": real, "real_tokens_per_s": round(real / median, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "program_bytes_mb": {k: round(v / 2**20, 2) for k, v in programs.items()}}


def timed_calls(run, lengths, repeats: int):
    """(the warm-up call's output, its seconds, the seconds of `repeats` more calls): run(seed) for
    seed 0 (warm-up: compiles, or sends an engine its weights) then 1..repeats, each timed; the
    warm-up's rows must have exactly their forced `lengths`."""
    import numpy as np

    start = time.perf_counter()
    out = run(0)
    first = time.perf_counter() - start
    if not (np.asarray(out.mask_BxC).sum(axis=1) == lengths).all():
        raise SystemExit("forced lengths were not honoured")
    times = []
    for seed in range(1, repeats + 1):
        start = time.perf_counter()
        run(seed)
        times.append(time.perf_counter() - start)
    return out, first, times


class _ForcedLengths:
    """The trainer's sampler with W3's lengths forced on every rollout of the step's 128 rows."""

    def __init__(self, inner, lengths):
        self._inner, self._lengths = inner, lengths

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, params, prompts, *, num_samples, sampling, rng):
        rows = len(prompts) * num_samples
        forced = self._lengths if rows == len(self._lengths) else None
        return self._inner(params, prompts, num_samples=num_samples, sampling=sampling, rng=rng, forced_lengths=forced)


def step_child(overrides: list[str], steps: int) -> dict:
    from grpo_jax.cli import bench
    from grpo_jax import config as config_lib
    from grpo_jax.training import run_context, train
    from grpo_jax.io.tokenizer import load_tokenizer

    lengths = bench.w3_completion_lengths(NUM_PROMPTS * GROUP)
    build_sampler = run_context.build_sampler
    run_context.build_sampler = lambda *a, **k: _ForcedLengths(build_sampler(*a, **k), lengths)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = bench.w1_config(os.path.join(tmp, "run"), steps=steps, prompts_per_step=NUM_PROMPTS,
                              num_generations=GROUP, max_new_tokens=bench.W3_MAX_NEW_TOKENS)
        cfg = config_lib.apply_overrides(cfg, ["sampling.ignore_eos=false", *overrides])
        start = time.perf_counter()
        result = train.run(cfg, task=bench.AdditionTask(), tokenizer=load_tokenizer("builtin"))
        wall = time.perf_counter() - start
    rows = [r for r in result.history if r.get("step", 0) >= 2]
    keys = sorted({k for r in rows for k in r if k.startswith("time/")})
    return {"overrides": overrides, "steps": steps, "wall_s": round(wall, 1),
            "median": {k: round(statistics.median(r[k] for r in rows if k in r), 3) for k in keys},
            "mean_length": round(statistics.mean(r["completions/mean_length"] for r in rows), 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def _child(args: list, script: str = __file__) -> dict:
    """`script --child ARGS` in a process of its own (its peak RSS is the configuration's); its last line, as JSON."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, script, "--child", json.dumps(args)], env=env, capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode:
        raise SystemExit(f"{args} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["w3"], default="w3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="train.run steps per configuration (0: no steps)")
    parser.add_argument("--continuous", nargs="*", default=["2:0:8"],
                        help="continuous configurations THREADS:SLOTS:REFILL_EVERY (SLOTS 0: auto)")
    parser.add_argument("--static-threads", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, *rest = json.loads(args.child)
        if kind == "rollout":
            print(json.dumps(rollout_child(*rest)))
        else:
            print(json.dumps(step_child(*rest)))
        return 0

    import numpy as np

    from grpo_jax.cli import bench

    lengths = bench.w3_completion_lengths(NUM_PROMPTS * GROUP)
    mask = np.arange(bench.W3_MAX_NEW_TOKENS)[None, :] < lengths[:, None]
    result: dict = {"bench": "rollout", "workload": args.workload, "rows": int(lengths.size),
                    "real_fraction": round(float(mask.mean()), 4), "load_before": [round(x, 2) for x in os.getloadavg()]}
    with tempfile.TemporaryDirectory() as tmp:
        static_tokens = os.path.join(tmp, "static.npy")
        result["static"] = _child(["rollout", "static", args.static_threads, 0, 8, args.repeats, static_tokens])
        result["continuous"] = []
        for spec in args.continuous:
            threads, slots, refill = (int(v) for v in spec.split(":"))
            path = os.path.join(tmp, f"continuous_{spec.replace(':', '_')}.npy")
            entry = _child(["rollout", "continuous", threads, slots, refill, args.repeats, path])
            same = np.load(path) == np.load(static_tokens)
            entry["identical_token_fraction"] = round(float(same[mask].mean()), 4)
            entry["speedup_vs_static"] = round(result["static"]["median_s"] / entry["median_s"], 2)
            result["continuous"].append(entry)
    if args.steps:
        result["steps"] = {
            "static, unbucketed (before issue 15)": _child(["step", ["sampling.engine=static",
                                                                     "grpo.bucket_by_length=off"], args.steps]),
            "static, bucketed": _child(["step", ["sampling.engine=static", "grpo.bucket_by_length=on"], args.steps]),
            "defaults (sampling.engine and grpo.bucket_by_length auto)": _child(["step", [], args.steps]),
        }
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
