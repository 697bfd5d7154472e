"""Scaling sweep around W1: step time against G, max_new_tokens and prompts per step; PNG + fits.

    .venv/bin/python benchmarks/sweep_w1.py                 # full sweep (slow: ~10 runs of 8 steps)
    .venv/bin/python benchmarks/sweep_w1.py --reduced       # G {4, 8, 16} and C {32, 64, 128} only

Each point is one `train.run` of the W1 model with one factor changed (the others at W1's 4 x 8 x
64), median step time over steps 3..N. The fitted exponent is the slope of log(step time) against
log(factor): ~1 means cost grows linearly with generated tokens (the KV cache does not re-run the
prefix). Writes benchmarks/results/sweep.json and sweep.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_w1 import run_w1  # noqa: E402

from grpo_jax.cli import bench

FULL = {"num_generations": [4, 8, 16], "max_new_tokens": [32, 64, 128, 256], "prompts_per_step": [2, 4, 8]}
REDUCED = {"num_generations": [4, 8, 16], "max_new_tokens": [32, 64, 128]}
BASE = {"num_generations": 8, "max_new_tokens": 64, "prompts_per_step": 4}


def sweep(axes: dict[str, list[int]], steps: int) -> dict:
    out = {}
    for name, values in axes.items():
        points = []
        for v in values:
            r = run_w1(steps=steps, measure_peak=False, **{**BASE, name: v})
            points.append({"value": v, "step_s": r["step_s_median"], "split_s": r["split_s_median"],
                           "generated_tokens": r["generated_tokens_per_step"]})
            print(f"{name}={v}: {r['step_s_median']:.3f} s/step "
                  f"({', '.join(f'{k} {s:.3f}' for k, s in r['split_s_median'].items())})", flush=True)
        xs, ys = [p["value"] for p in points], [p["step_s"] for p in points]
        rollout = [p["split_s"]["rollout"] for p in points]
        out[name] = {"points": points, "exponent_step": bench.fit_exponent(xs, ys),
                     "exponent_rollout": bench.fit_exponent(xs, rollout)}
        print(f"{name}: step time ~ x^{out[name]['exponent_step']:.2f}, rollout ~ "
              f"x^{out[name]['exponent_rollout']:.2f}", flush=True)
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result), figsize=(4.5 * len(result), 3.8), squeeze=False)
    for ax, (name, r) in zip(axes[0], result.items()):
        xs = [p["value"] for p in r["points"]]
        ax.loglog(xs, [p["step_s"] for p in r["points"]], "o-", label=f"step (x^{r['exponent_step']:.2f})")
        ax.loglog(xs, [p["split_s"]["rollout"] for p in r["points"]], "s--",
                  label=f"rollout (x^{r['exponent_rollout']:.2f})")
        ax.set_xlabel(name)
        ax.set_ylabel("seconds (median, steps 3..N)")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("grpo_jax W1 scaling (others at 4 prompts x G=8 x 64 tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reduced", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--replot", default="", help="redraw the PNG from this sweep JSON; no runs")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), os.path.splitext(args.replot)[0] + ".png")
        return
    result = sweep(REDUCED if args.reduced else FULL, args.steps)
    os.makedirs(args.out_dir, exist_ok=True)
    name = "sweep_reduced" if args.reduced else "sweep"
    with open(os.path.join(args.out_dir, name + ".json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.join(args.out_dir, name + ".png"))
    print(f"wrote {args.out_dir}/{name}.json and .png")


if __name__ == "__main__":
    main()
