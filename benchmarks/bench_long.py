"""Reasoning lengths on a CPU (issue 22): the unused-budget test, decode time against position, and
W4, each configuration in its own process (peak RSS is the process's). Prints one JSON line.

    .venv/bin/python benchmarks/bench_long.py budget     [--repeats 3]
    .venv/bin/python benchmarks/bench_long.py positions  [--repeats 2]
    .venv/bin/python benchmarks/bench_long.py w4         [--steps 3]

budget: W3's 128 rows (16 prompts x G=8, W1's model, lengths `bench.w3_completion_lengths`, all
<= 512, mean 143) decoded with max_new_tokens=512 and with 4096, through both engines. Today's
decode attends only over the cache blocks written so far.
positions: 32 rows (4 prompts x 8) all forced to stop after L tokens, L in 512 .. 4096, with
max_new_tokens=4096, static engine: seconds per generated token against L.
w4: W1's model and workload (4 prompts x G=8, beta 0.04) with completions forced to
`bench.w4_completion_lengths` (median 500, up to 4,096), grad_accum_steps=4, through `train.run`:
rollout / log-prob / update seconds (median of steps 2..N) and peak RSS.
--before PATH: also run each configuration on the code checked out at PATH (a git worktree of
the commit before issue 22: `git worktree add /tmp/old 41b706d`), whose static engine grows its
cache in segments of max(64, C / 8) tokens, whose continuous engine attends over all P + C slots
every step, and whose attention materialises the scores. Same process layout, same lengths.
Run on a quiet machine, under `flock /tmp/bench.lock` when others benchmark.
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

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
PROMPT_TOKENS = 29


def _sampler_and_params(engine: str, threads: int, mesh=True):
    import jax
    from flax import nnx

    from grpo_jax.distributed import sharding
    from grpo_jax.model import init_model
    from grpo_jax.sampling.sampler import Sampler

    sys.path.insert(0, BENCH_DIR)
    from bench_rollout import _model

    config = _model()
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: init_model(config, 0)))
    params = jax.jit(lambda: nnx.split(init_model(config, 0))[1])()
    sampler = Sampler(graphdef, config, eos_id=1, pad_id=0, threads=threads, engine=engine,
                      mesh=sharding.make_mesh(1, 1, 1) if mesh else None)
    return sampler, params, config


def _time_calls(run, repeats: int) -> tuple[float, list[float]]:
    start = time.perf_counter()
    run(0)
    first = time.perf_counter() - start
    times = []
    for seed in range(1, repeats + 1):
        start = time.perf_counter()
        run(seed)
        times.append(time.perf_counter() - start)
    return first, times


def rollout_child(engine: str, max_new_tokens: int, lengths: list[int], num_prompts: int, group: int,
                  repeats: int, code: str) -> dict:
    import jax
    import numpy as np

    from grpo_jax.sampling.sampler import SamplingConfig

    sampler, params, config = _sampler_and_params(engine, threads=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, config.vocab_size, PROMPT_TOKENS).tolist() for _ in range(num_prompts)]
    forced = np.asarray(lengths)
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0)

    def run(seed):
        out = sampler(params, prompts, num_samples=group, sampling=sampling, rng=jax.random.key(seed),
                      forced_lengths=forced)
        out = jax.block_until_ready(out)
        if not (np.asarray(out.mask_BxC).sum(axis=1) == forced).all():
            raise SystemExit("forced lengths were not honoured")

    first, times = _time_calls(run, repeats)
    median = statistics.median(times)
    return {"engine": engine, "max_new_tokens": max_new_tokens, "code": code,
            "median_s": round(median, 3), "min_s": round(min(times), 3), "compile_s": round(first - median, 2),
            "real_tokens": int(forced.sum()),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


class _ForcedLengths:
    """The trainer's sampler with fixed lengths forced on every rollout of the step's rows."""

    def __init__(self, inner, lengths):
        self._inner, self._lengths = inner, lengths

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, params, prompts, *, num_samples, sampling, rng):
        rows = len(prompts) * num_samples
        forced = self._lengths if rows == len(self._lengths) else None
        return self._inner(params, prompts, num_samples=num_samples, sampling=sampling, rng=rng, forced_lengths=forced)


def w4_child(code: str, steps: int, lengths: list[int], max_new_tokens: int) -> dict:
    import numpy as np

    from grpo_jax.cli import bench
    from grpo_jax import config as config_lib
    from grpo_jax.training import run_context, train
    from grpo_jax.io.tokenizer import load_tokenizer

    lengths = np.asarray(lengths)
    build_sampler = run_context.build_sampler
    run_context.build_sampler = lambda *a, **k: _ForcedLengths(build_sampler(*a, **k), lengths)
    overrides = ["sampling.ignore_eos=false", "grpo.grad_accum_steps=4"]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = bench.w1_config(os.path.join(tmp, "run"), steps=steps, max_new_tokens=max_new_tokens)
        cfg = config_lib.apply_overrides(cfg, overrides)
        start = time.perf_counter()
        result = train.run(cfg, task=bench.AdditionTask(), tokenizer=load_tokenizer("builtin"))
        wall = time.perf_counter() - start
    rows = [r for r in result.history if r.get("step", 0) >= 2]
    keys = sorted({k for r in rows for k in r if k.startswith("time/")})
    return {"code": code, "overrides": overrides,
            "steps": steps, "wall_s": round(wall, 1),
            "median": {k: round(statistics.median(r[k] for r in rows if k in r), 3) for k in keys},
            "mean_length": round(statistics.mean(r["completions/mean_length"] for r in rows), 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def _child(args: list, tree: str | None = None) -> dict:
    """One configuration in its own process, importing grpo_jax from `tree` (default: this one)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=tree or os.path.dirname(BENCH_DIR))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)], env=env, capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode:
        return {"args": args, "failed": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", choices=["budget", "positions", "w4"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--before", metavar="PATH", help="also run the code checked out at PATH (see above)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, *rest = json.loads(args.child)
        print(json.dumps(rollout_child(*rest) if kind == "rollout" else w4_child(*rest)))
        return 0

    from grpo_jax.cli import bench

    trees = [("today", None)] + ([("before", args.before)] if args.before else [])
    result: dict = {"bench": "long", "part": args.part, "load_before": [round(x, 2) for x in os.getloadavg()],
                    "runs": []}
    if args.part == "budget":
        lengths = bench.w3_completion_lengths(128).tolist()
        for engine in ("static", "continuous"):
            for code, tree in trees:
                pair = [_child(["rollout", engine, c, lengths, 16, 8, args.repeats, code], tree) for c in (512, 4096)]
                if all("median_s" in p for p in pair):
                    pair[1]["ratio_to_512"] = round(pair[1]["median_s"] / pair[0]["median_s"], 3)
                result["runs"] += pair
    elif args.part == "positions":
        for code, tree in trees:
            for length in (512, 1024, 2048, 4096):
                entry = _child(["rollout", "static", 4096, [length] * 32, 4, 8, args.repeats, code], tree)
                if "median_s" in entry:
                    entry["ms_per_token"] = round(1e3 * entry["median_s"] / length, 3)
                result["runs"].append(entry)
    else:
        lengths = bench.w4_completion_lengths().tolist()
        result["runs"] = [_child(["w4", code, args.steps, lengths, bench.W4_MAX_NEW_TOKENS], tree)
                          for code, tree in trees]
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
