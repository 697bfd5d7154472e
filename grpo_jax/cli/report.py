"""After a run: the before/after table of held-out figures, and the PNG curves."""

from __future__ import annotations

import json

import jax

from grpo_jax import config as config_lib
from grpo_jax.io import run_paths
from grpo_jax.training import train


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


def run_evaluations(run_dir: str) -> list[dict]:
    """Every held-out evaluation of the run in its metrics.jsonl, across resumes (the last row
    written for a step wins), in step order."""
    from grpo_jax.io.metrics import read_metrics

    if not (run_paths.as_path(run_dir) / "metrics.jsonl").is_file():
        return []
    rows = {r["step"]: r for r in read_metrics(run_dir) if "eval/pass@1" in r}
    return [rows[step] for step in sorted(rows)]


def run_and_report(config: config_lib.Config, **run_kwargs) -> train.RunResult:
    """`train.run(config, **run_kwargs)`, then the before/after table (printed and in summary.md,
    from every evaluation the run has logged, so a resumed run reports the whole run) and plots."""
    result = train.run(config, **run_kwargs)
    if jax.process_index() != 0 or (result.stopped_by and not result.history):
        return result  # another process's, or stopped before any step: nothing to report
    table = before_after_table(run_evaluations(result.run_dir) or result.evals)
    print("\n" + table + "\n")
    run_dir = run_paths.as_path(result.run_dir)
    (run_dir / "summary.md").write_text(table + "\n")
    if (run_dir / "sft.json").exists():
        sft = json.loads((run_dir / "sft.json").read_text())
        print(f"SFT warm-up: {sft['steps']} steps in {sft['seconds']:.1f} s")
    from grpo_jax.io import plot

    written = plot.plot_run(result.run_dir)
    print(f"plots: {run_dir / 'plots'} ({len(written)} files)")
    return result
