"""The multi-turn CPU demo with its calculator and without it, in one sitting (issue 27, item 7).

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_tool_demo.py [--out F] [--seed S ...] [--set K=V ...]

Runs `python -m grpo_jax train --config configs/arith_tools_cpu.py` twice per seed, each in a fresh
run directory: "tool" (the calculator answers "?") and "no tool" (`task.options.tool=false`: every
episode ends after the first turn, so the model must multiply itself; its warm-up trains on the
problems and their answers instead). Same model, seeds, SFT cap, GRPO steps and token budget.
Prints, per run: held-out greedy success and pass@1 before GRPO (step 0, after the warm-up) and
after, the greedy curve, the warm-up's length, tool calls per episode at the end and the wall time
of the whole command (SFT, compiles and evaluations included). Writes
benchmarks/results/tool_demo.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
from pathlib import Path

from grpo_jax.cli.bench import train_cli

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/arith_tools_cpu.py"
VARIANTS = {"tool": ["task.options.tool=true"], "no tool": ["task.options.tool=false"]}


def seed_overrides(seed: int | None) -> list[str]:
    """Every seed of the run set to `seed` (None: the config's own, 1)."""
    if seed is None:
        return []
    return [f"train.seed={seed}", f"model.init_seed={seed}", f"task.options.seed={seed}"]


def run_demo(overrides: list[str], run_dir: str) -> dict:
    started = datetime.datetime.now(datetime.timezone.utc)
    wall, rows = train_cli(CONFIG, run_dir, overrides, cwd=REPO)
    steps = [r for r in rows if r["step"] > 0 and "reward" in r]
    evals = [r for r in rows if "eval/greedy_accuracy" in r]
    sft = json.loads((Path(run_dir) / "sft.json").read_text())
    last = steps[-10:]
    return {
        "started_utc": started.strftime("%H:%M:%S"),
        "wall_s": wall,
        "sft_steps": sft["steps"],
        "sft_valid_greedy": sft["history"][-1]["valid_greedy_accuracy"],
        "grpo_steps": len(steps),
        "greedy_before": evals[0]["eval/greedy_accuracy"],
        "greedy_after": evals[-1]["eval/greedy_accuracy"],
        "pass@1_before": evals[0]["eval/pass@1"],
        "pass@1_after": evals[-1]["eval/pass@1"],
        "greedy_curve": [(r["step"], r["eval/greedy_accuracy"]) for r in evals],
        "reward_last10": sum(r["reward"] for r in last) / len(last),
        "tool_calls_last10": sum(r.get("tools/calls", 0.0) for r in last) / len(last),
        "turns_last10": sum(r.get("turns/mean", 0.0) for r in last) / len(last),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "tool_demo.json"))
    parser.add_argument("--seed", type=int, action="append", default=[],
                        help="run both variants with every seed set to S (repeatable; default: the config's)")
    parser.add_argument("--set", action="append", default=[], help="extra override for every run")
    args = parser.parse_args()
    seeds = args.seed or [None]
    runs = []
    with tempfile.TemporaryDirectory(prefix="grpo_jax_tool_demo_") as tmp:
        for seed in seeds:
            for name, overrides in VARIANTS.items():
                run_dir = os.path.join(tmp, f"{name.replace(' ', '_')}_{seed}")
                result = run_demo([*overrides, *seed_overrides(seed), *args.set], run_dir)
                runs.append({"variant": name, "seed": 1 if seed is None else seed, **result})
                print(f"{name:8s} seed {runs[-1]['seed']}: held-out greedy {result['greedy_before']:.3f} -> "
                      f"{result['greedy_after']:.3f}, pass@1 {result['pass@1_before']:.3f} -> "
                      f"{result['pass@1_after']:.3f}; SFT {result['sft_steps']} steps; "
                      f"tool calls/episode {result['tool_calls_last10']:.2f}; wall {result['wall_s']:.0f} s "
                      f"(from {result['started_utc']} UTC)", flush=True)
                print(f"         greedy curve {result['greedy_curve']}", flush=True)
    Path(args.out).write_text(json.dumps({"config": CONFIG, "overrides": args.set, "cpu_count": os.cpu_count(),
                                          "load_average_at_end": os.getloadavg(), "runs": runs}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
