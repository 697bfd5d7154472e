"""After a run: the before/after table of held-out figures, and the PNG curves."""

from __future__ import annotations

import json
import os

from grpo_jax import config as config_lib
from grpo_jax import train


def before_after_table(evals: list[dict]) -> str:
    """A Markdown table of the first and the last held-out evaluation."""
    if not evals:
        return "(no held-out evaluation ran)"
    first, last = evals[0], evals[-1]
    keys = [k for k in first if k.startswith("eval/") and k != "eval/time"]
    lines = [f"| held-out metric | step {first['step']} | step {last['step']} |", "|---|---|---|"]
    for k in keys:
        lines.append(f"| {k[5:]} | {first[k]:.3f} | {last.get(k, float('nan')):.3f} |")
    return "\n".join(lines)


def run_and_report(config: config_lib.Config, *, resume: bool = False) -> train.RunResult:
    result = train.run(config, resume=resume)
    table = before_after_table(result.evals)
    print("\n" + table + "\n")
    with open(os.path.join(result.run_dir, "summary.md"), "w") as f:
        f.write(table + "\n")
    if os.path.exists(os.path.join(result.run_dir, "sft.json")):
        with open(os.path.join(result.run_dir, "sft.json")) as f:
            sft = json.load(f)
        print(f"SFT warm-up: {sft['steps']} steps in {sft['seconds']:.1f} s")
    from grpo_jax import plot

    written = plot.plot_run(result.run_dir)
    print(f"plots: {os.path.join(result.run_dir, 'plots')} ({len(written)} files)")
    return result
