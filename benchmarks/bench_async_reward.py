"""A slow reward function, synchronous and with asynchronous rollouts (issue 27, item 6).

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_async_reward.py [--delay-ms 40] [--repeats R]

The CPU demo (configs/arith_cpu.py, seed fixed) with its reward function held `--delay-ms` per
batch call before it scores, as a judge service's round trip would hold it. Each variant runs
`train.run(config, task=...)` in a fresh process (no compile cache or thread shared between them):

    sync        off_policy.max_staleness=0: sample, score, update, in series
    async k=1   off_policy.max_staleness=1: the rollout thread samples step n+1 while step n is
                scored, and both while the trainer updates

Prints per variant the median step period (`time/step`, steps after the first 20 warm-up ones),
the median `time/reward`, how long the trainer waited for its batch (`async/rollout_wait`) and the
final held-out greedy accuracy; then the period ratio async / sync of each pair. Writes everything
to benchmarks/results/async_reward.json (`--out`); `--steps N` shortens the runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "arith_cpu.py"
VARIANTS = {"sync": 0, "async k=1": 1}
WARMUP_STEPS = 20  # compiles and the first evaluation fall in these; the median starts after them


class DelayedRewards:
    """`task` with each reward function's batch call held `delay_s` first; the values are the task's own."""

    def __init__(self, task, delay_s: float):
        self.task, self.delay_s = task, delay_s

    def reward_fns(self):
        return [dataclasses.replace(spec, fn=_delayed(spec.fn, self.delay_s)) for spec in self.task.reward_fns()]

    def __getattr__(self, attr):  # data, held-out checker, answer extraction: the task's
        if attr == "task":
            raise AttributeError(attr)
        return getattr(self.task, attr)


def _delayed(fn, delay_s: float):
    # Not functools.wraps: the trainer sees through __wrapped__ and would run this as a built-in
    # function; a user's judge call runs the way user reward functions run (interruptible).
    def judged(prompts, completions, **fields):
        time.sleep(delay_s)
        return fn(prompts=prompts, completions=completions, **fields)

    judged.__name__ = f"delayed_{getattr(fn, '__name__', 'reward')}"
    return judged


def run_variant(max_staleness: int, delay_s: float, steps: int | None, run_dir: str) -> dict:
    """One run in this process: its step rows' figures and its held-out evaluations."""
    from grpo_jax.config.files import load_config_file
    from grpo_jax.config.overrides import apply_overrides
    from grpo_jax.training import run_context, train

    overrides = [f"off_policy.max_staleness={max_staleness}", f"train.run_dir={run_dir}", "train.progress=false"]
    if steps is not None:
        overrides.append(f"train.steps={steps}")
    config = apply_overrides(load_config_file(CONFIG), overrides)
    task = DelayedRewards(run_context.configured_task(config), delay_s)
    t0 = time.perf_counter()
    result = train.run(config, task=task)
    wall = time.perf_counter() - t0
    rows = [r for r in result.history if r["step"] > 0 and "time/step" in r][WARMUP_STEPS:]
    return {
        "wall_s": wall,
        "grpo_steps": result.step,
        "step_ms_median": 1e3 * statistics.median(r["time/step"] for r in rows),
        "reward_ms_median": 1e3 * statistics.median(r["time/reward"] for r in rows),
        "rollout_wait_ms_median": (1e3 * statistics.median(r["async/rollout_wait"] for r in rows)
                                   if max_staleness else None),
        "final_greedy": result.evals[-1]["eval/greedy_accuracy"],
        "eval_curve": [(e["step"], e["eval/greedy_accuracy"]) for e in result.evals],
        "mean_staleness": statistics.mean(r.get("async/staleness", 0.0) for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, default=40.0, help="the reward's wait per batch call")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the config's)")
    parser.add_argument("--repeats", type=int, default=1, help="sync / async pairs, alternating")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "async_reward.json"))
    parser.add_argument("--child", nargs=3, metavar=("K", "RUN_DIR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # one variant, in this fresh process
        k, run_dir, out = args.child
        Path(out).write_text(json.dumps(run_variant(int(k), args.delay_ms / 1e3, args.steps, run_dir)))
        return

    results = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="grpo_jax_async_reward_") as tmp:
        for r in range(args.repeats):  # alternating, so a change in the machine's load hits both
            for name, k in VARIANTS.items():
                out = os.path.join(tmp, f"k{k}_{r}.json")
                cmd = [sys.executable, __file__, "--delay-ms", str(args.delay_ms), "--child", str(k),
                       os.path.join(tmp, f"run_k{k}_{r}"), out]
                if args.steps is not None:
                    cmd += ["--steps", str(args.steps)]
                proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                                      env=dict(os.environ, PYTHONPATH=str(REPO)))
                if proc.returncode != 0:
                    raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
                res = json.loads(Path(out).read_text())
                res["load_avg_after"] = os.getloadavg()
                results[name].append(res)
                wait = res["rollout_wait_ms_median"]
                print(f"{name:10s} step period {res['step_ms_median']:6.1f} ms (median)  "
                      f"reward {res['reward_ms_median']:5.1f} ms  "
                      f"{'' if wait is None else f'trainer waited {wait:5.1f} ms  '}"
                      f"final greedy {res['final_greedy']:.3f}  wall {res['wall_s']:6.1f} s  "
                      f"load {res['load_avg_after'][0]:.1f}", flush=True)
    ratios = [a["step_ms_median"] / s["step_ms_median"] for a, s in zip(results["async k=1"], results["sync"])]
    print(f"async k=1 / sync step period: {', '.join(f'{x:.2f}x' for x in ratios)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "config": "configs/arith_cpu.py", "delay_ms": args.delay_ms, "steps": args.steps,
        "warmup_steps_excluded": WARMUP_STEPS, "cpu_count": os.cpu_count(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "period_ratios_async_over_sync": ratios, "runs": results,
    }, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
