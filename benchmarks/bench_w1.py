"""W1 through `train.run`: median step time (steps 3..12) and its split, tokens/s, peak RSS, FLOPs,
achieved FLOP/s against this machine's fp32 matmul peak (measured here). Writes a JSON file.

    .venv/bin/python benchmarks/bench_w1.py [--out benchmarks/results/w1.json] [--steps 12]
    .venv/bin/python -m grpo_jax.cli.bench     # the same

The workload is defined in grpo_jax/cli/bench.py (and /work/shared/peers/WORKLOAD.md). Run it on a
quiet machine (1-minute load <= 1.5), under `flock /tmp/bench.lock` when others benchmark too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import tempfile
import time

import jax

from grpo_jax.cli import bench
from grpo_jax.training import train
from grpo_jax.model import ModelConfig
from grpo_jax.tasks import RewardSpec
from grpo_jax.io.tokenizer import load_tokenizer


class _TimedTask(bench.AdditionTask):
    """The W1 task whose reward function also adds up the seconds it spends (the reward split)."""

    def __init__(self):
        super().__init__()
        self.reward_seconds: list[float] = []
        self.reward_called_at: list[float] = []  # one call per step: the gaps are wall time per step

    def reward_fns(self):
        def timed(prompts, completions, **fields):
            t0 = time.perf_counter()
            self.reward_called_at.append(t0)
            out = bench.boxed_sum_reward(prompts, completions, **fields)
            self.reward_seconds.append(time.perf_counter() - t0)
            return out
        return [RewardSpec("boxed_sum", timed, 1.0)]


def run_w1(*, steps: int = 12, prompts_per_step: int = 4, num_generations: int = 8, max_new_tokens: int = 64,
           measure_peak: bool = True, run_dir: str | None = None, config_overrides: tuple[str, ...] = ()) -> dict:
    """One W1-shaped run; returns the result dict (see the module docstring). `config_overrides`:
    --set style "section.field=value" changes (benchmarks/bench_vllm.py: sampling.engine=vllm), with
    the run's per-step rows under "history"."""
    run_dir = run_dir or tempfile.mkdtemp(prefix="grpo_w1_")
    config = bench.w1_config(run_dir, steps=steps, prompts_per_step=prompts_per_step,
                             num_generations=num_generations, max_new_tokens=max_new_tokens)
    if config_overrides:
        from grpo_jax import config as config_lib

        config = config_lib.apply_overrides(config, list(config_overrides))
    task = _TimedTask()
    tokenizer = bench.WideVocabTokenizer(load_tokenizer(config.model.tokenizer_spec()))
    t0 = time.perf_counter()
    result = train.run(config, task=task, tokenizer=tokenizer)
    wall = time.perf_counter() - t0
    first = min(3, steps)
    summary = bench.summarize_steps(result.history, first=first, last=steps)
    m = config.model
    model_config = ModelConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                               intermediate_size=m.intermediate_size, num_layers=m.num_layers,
                               num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                               qkv_bias=m.qkv_bias)
    flops = bench.grpo_step_flops(model_config, num_prompts=prompts_per_step, group=num_generations,
                                  prompt_len=bench.W1_PROMPT_LEN, new_tokens=max_new_tokens)
    # What runs: each prompt once per group where the trainer chose that (on one device: both passes).
    executed = bench.executed_step_flops(config, model_config, prompt_len=bench.W1_PROMPT_LEN,
                                         num_devices=len(jax.devices()))
    step_s = summary["time/step"]
    tokens = prompts_per_step * num_generations * max_new_tokens
    rewards = task.reward_seconds[first - 1:steps]
    # Wall time per step from the host's clock alone (the gap between consecutive steps' reward
    # calls), whatever the trainer counts as a step's time; steps first+1..steps.
    gaps = sorted(b - a for a, b in zip(task.reward_called_at[first - 1:steps], task.reward_called_at[first:steps]))
    out = {
        "workload": f"W1 {prompts_per_step}x{num_generations}x{max_new_tokens}",
        "step_s_median": step_s,
        "wall_step_s_median": gaps[len(gaps) // 2] if gaps else None,
        "split_s_median": {k.split("/", 1)[1]: v for k, v in summary.items() if k.startswith("time/")
                           and k != "time/step"},
        "reward_s_median": float(sorted(rewards)[len(rewards) // 2]) if rewards else None,
        "steps_measured": summary["steps_measured"],
        "step_s_all": [r["time/step"] for r in result.history],
        "generated_tokens_per_step": tokens,
        "generated_tokens_per_s": tokens / step_s,
        "rollout_tokens_per_s": tokens / summary["time/rollout"],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "flops_per_step": {"rollout": flops.rollout, "reference": flops.reference, "policy": flops.policy,
                           "total": flops.total},
        "executed_flops_per_step": {"rollout": executed.rollout, "reference": executed.reference,
                                    "policy": executed.policy, "total": executed.total},
        "achieved_flops_per_s": executed.total / step_s,
        "total_wall_s": wall,
        "recompiles_after_warmup": sum(r.get("recompiles", 0) for r in result.history),
        "jax": jax.__version__, "backend": jax.default_backend(), "devices": len(jax.devices()),
        "cpu_count": os.cpu_count(), "machine": platform.machine(),
        "loadavg_before_after": None,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    if config_overrides:
        out["history"] = result.history
    if measure_peak:
        peak = bench.matmul_peak_flops()
        out["matmul_peak_flops_per_s"] = peak
        out["fraction_of_peak"] = out["achieved_flops_per_s"] / peak
        out["floor_s_at_peak"] = executed.total / peak
        out["workload_floor_s_at_peak"] = flops.total / peak
    return out


def print_result(r: dict) -> None:
    split = ", ".join(f"{k} {v:.3f}" for k, v in r["split_s_median"].items())
    print(f"{r['workload']}: median step {r['step_s_median']:.3f} s over {r['steps_measured']} steps, "
          f"wall {r['wall_step_s_median'] or float('nan'):.3f} s/step "
          f"({split}; reward {r['reward_s_median'] or 0:.4f})")
    print(f"  generated {r['generated_tokens_per_s']:.0f} tokens/s (rollout alone "
          f"{r['rollout_tokens_per_s']:.0f}), peak RSS {r['peak_rss_mib']:.0f} MiB")
    f, e = r["flops_per_step"], r["executed_flops_per_step"]
    print(f"  FLOPs/step: workload {f['total'] / 1e9:.1f} G (rollout {f['rollout'] / 1e9:.1f}, reference "
          f"{f['reference'] / 1e9:.1f}, policy fwd+bwd {f['policy'] / 1e9:.1f}); executed {e['total'] / 1e9:.1f} G "
          f"(reference {e['reference'] / 1e9:.1f}, policy {e['policy'] / 1e9:.1f}: each prompt once per group); "
          f"achieved {r['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s")
    if "matmul_peak_flops_per_s" in r:
        print(f"  fp32 matmul peak {r['matmul_peak_flops_per_s'] / 1e9:.1f} GFLOP/s: "
              f"{100 * r['fraction_of_peak']:.0f}% of peak; floor {r['floor_s_at_peak']:.3f} s/step "
              f"(workload floor {r['workload_floor_s_at_peak']:.3f})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/w1.json")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--no-peak", action="store_true", help="skip the matmul peak measurement")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error(f"--steps must be >= 3 (the figure is the median over steps 3..N), got {args.steps}")
    load_before = os.getloadavg()
    r = run_w1(steps=args.steps, measure_peak=not args.no_peak)
    r["loadavg_before_after"] = [list(load_before), list(os.getloadavg())]
    print_result(r)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(r, f, indent=2)
    print(f"  wrote {args.out}")


if __name__ == "__main__":
    main()
