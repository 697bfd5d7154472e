"""W1 steps and W3 rollouts with sampling.engine="vllm" next to the built-in engines, each
configuration in its own process. Prints one JSON line.

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--steps 12] [--repeats 3] [--only w1|w3]

Needs a venv with vLLM (launch/vllm_cpu_env.sh on a CPU; on a GPU, vllm beside jax[cuda]).
W1 (grpo_jax/cli/bench.py): `train.run` on 4 prompts x G=8 x 64 new tokens, median step of steps
3..N, its time/rollout and time/weight_sync. W3 (benchmarks/bench_rollout.py): 16 prompts x G=8
rows of W1's model with long-tailed forced lengths (max 512), median of --repeats calls after a
warm-up; vLLM forces a row's length with max_tokens and ignore_eos, the built-in engines by masking
logits, so both produce the same number of tokens per row. On a CPU the figures are informative:
vLLM's CPU backend is not where it is fast. Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_rollout  # noqa: E402


def w1_child(engine: str, steps: int) -> dict:
    import bench_w1

    overrides = {"vllm": ["sampling.engine=vllm", "sampling.vllm_gpu_memory_utilization=0.2"]}.get(
        engine, ["sampling.engine=auto"])
    result = bench_w1.run_w1(steps=steps, measure_peak=False, config_overrides=overrides)
    weight_sync = [r["time/weight_sync"] for r in result.pop("history") if "time/weight_sync" in r]
    keep = ("step_s_median", "wall_step_s_median", "split_s_median", "generated_tokens_per_s", "rollout_tokens_per_s",
            "peak_rss_mib", "total_wall_s")
    out = {"engine": engine, **{k: result[k] for k in keep}}
    out["weight_sync_s_median"] = statistics.median(weight_sync[2:]) if len(weight_sync) > 2 else None
    return out


def w3_vllm_child(repeats: int) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from grpo_jax.cli import bench
    from grpo_jax.io import hf
    from grpo_jax.model import init_model
    from grpo_jax.sampling.engine import SamplingConfig
    from grpo_jax.sampling.vllm_backends import Colocated, EngineOptions
    from grpo_jax.sampling.vllm_engine import VllmEngine

    config = bench_rollout._model()
    model = init_model(config, 0)
    params = nnx.state(model, nnx.Param)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_model(model, tmp)
        start = time.perf_counter()
        backend = Colocated(EngineOptions(model_dir=tmp, dtype="float32", gpu_memory_utilization=0.2,
                                          max_model_len=1024))
        engine_start = time.perf_counter() - start
    engine = VllmEngine(backend, config, eos_ids=(1,), pad_id=0, prompt_buckets=(32,))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, config.vocab_size, bench_rollout.PROMPT_TOKENS).tolist()
               for _ in range(bench_rollout.NUM_PROMPTS)]
    lengths = bench.w3_completion_lengths(bench_rollout.NUM_PROMPTS * bench_rollout.GROUP)
    sampling = SamplingConfig(max_new_tokens=bench.W3_MAX_NEW_TOKENS, temperature=1.0)

    def run(seed):
        return engine(params, prompts, num_samples=bench_rollout.GROUP, sampling=sampling, rng=jax.random.key(seed),
                      forced_lengths=lengths)

    _, first, times = bench_rollout.timed_calls(run, lengths, repeats)  # the first call also sends the weights
    median, real = statistics.median(times), int(lengths.sum())
    return {"engine": "vllm", "median_s": round(median, 3), "min_s": round(min(times), 3),
            "first_call_s": round(first, 2), "engine_start_s": round(engine_start, 1), "real_tokens": real,
            "real_tokens_per_s": round(real / median, 1)}


def _child(args: list) -> dict:
    return bench_rollout._child(args, script=__file__)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=["w1", "w3"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, *rest = json.loads(args.child)
        print(json.dumps({"w1": w1_child, "w3_vllm": w3_vllm_child}[kind](*rest)))
        return 0
    result: dict = {"bench": "vllm", "load_before": [round(x, 2) for x in os.getloadavg()]}
    if args.only in (None, "w1"):
        result["w1"] = [_child(["w1", engine, args.steps]) for engine in ("builtin", "vllm")]
    if args.only in (None, "w3"):
        with tempfile.TemporaryDirectory() as tmp:
            ours = bench_rollout._child(["rollout", "continuous", 2, 0, 8, args.repeats, os.path.join(tmp, "t.npy")])
        result["w3"] = [ours, _child(["w3_vllm", args.repeats])]
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
