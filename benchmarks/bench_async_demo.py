"""The CPU demo synchronously and with asynchronous rollouts, in one sitting (issue 16's target).

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_async_demo.py [--out F] [--repeats N] [--lora] [--set K=V ...]

Runs `python -m grpo_jax train --config configs/arith_cpu.py` once per variant (same seed, each
in a fresh run directory, alternating sync / async when --repeats > 1) and prints, per run: wall
time of the whole command, the median pipeline period (`time/step`) and phases, the final held-out
greedy accuracy and pass@1, the mean staleness and the step at which greedy accuracy first reached
0.90. `--lora` adds the LoRA demo (configs/arith_cpu_lora.py, issue 17's target). Writes everything
to benchmarks/results/async_demo.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from grpo_jax.cli.bench import train_cli

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {
    "sync": ["off_policy.max_staleness=0"],
    "async k=1": ["off_policy.max_staleness=1"],
}
LORA_VARIANT = {"lora r=16 (sync)": []}  # configs/arith_cpu_lora.py, with --lora


def run_demo(overrides: list[str], run_dir: str, config: str = "configs/arith_cpu.py") -> dict:
    wall, rows = train_cli(config, run_dir, overrides, cwd=REPO)
    steps = [r for r in rows if r["step"] > 0 and "time/step" in r]
    evals = [r for r in rows if "eval/greedy_accuracy" in r]
    reached = next((r["step"] for r in evals if r["eval/greedy_accuracy"] >= 0.90), None)
    return {
        "wall_s": wall,
        "grpo_steps": len(steps),
        "step_s_median": statistics.median(r["time/step"] for r in steps[20:]),
        "rollout_s_median": statistics.median(r["time/rollout"] for r in steps[20:]),
        "update_s_median": statistics.median(r["time/update"] for r in steps[20:]),
        "final_greedy": evals[-1]["eval/greedy_accuracy"],
        "final_pass@1": evals[-1]["eval/pass@1"],
        "eval_curve": [(r["step"], r["eval/greedy_accuracy"]) for r in evals],
        "eval_first": {k: v for k, v in evals[0].items() if k.startswith("eval/")},
        "eval_last": {k: v for k, v in evals[-1].items() if k.startswith("eval/")},
        "first_step_at_0.90": reached,
        "mean_staleness": statistics.mean(r.get("async/staleness", 0.0) for r in steps),
        "weight_sync_s_median": statistics.median(r.get("time/weight_sync", 0.0) for r in steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "async_demo.json"))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], help="extra override for every variant")
    parser.add_argument("--lora", action="store_true", help="also run configs/arith_cpu_lora.py once per repeat")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME:K=V[,K=V...]: an extra variant of configs/arith_cpu.py")
    args = parser.parse_args()
    variants = {name: (o, "configs/arith_cpu.py") for name, o in VARIANTS.items()}
    for spec in args.variant:
        name, _, overrides = spec.partition(":")
        variants[name] = (overrides.split(","), "configs/arith_cpu.py")
    if args.lora:
        variants.update({name: (o, "configs/arith_cpu_lora.py") for name, o in LORA_VARIANT.items()})
    results = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="grpo_jax_async_demo_") as tmp:
        for r in range(args.repeats):
            for name, (overrides, config) in variants.items():
                run_dir = os.path.join(tmp, f"{name.replace(' ', '_').replace('=', '')}_{r}")
                res = run_demo(overrides + args.set, run_dir, config)
                results[name].append(res)
                print(f"{name:10s} wall {res['wall_s']:6.1f} s  step {res['step_s_median'] * 1e3:5.1f} ms  "
                      f"rollout {res['rollout_s_median'] * 1e3:5.1f} ms  update {res['update_s_median'] * 1e3:5.1f} ms  "
                      f"greedy {res['final_greedy']:.3f}  pass@1 {res['final_pass@1']:.3f}  "
                      f">=0.90 at step {res['first_step_at_0.90']}  staleness {res['mean_staleness']:.2f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"overrides": args.set, "cpu_count": os.cpu_count(), "runs": results,
                                          "when": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
