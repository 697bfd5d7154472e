"""PNG training curves from ``RUN_DIR/metrics.jsonl`` into ``RUN_DIR/plots/``.

    python -m grpo_jax.io.plot RUN_DIR [--out DIR] [--smooth 10]

One PNG per panel (reward, held-out accuracy, KL, entropy, length, truncation, zero-variance
fraction, clip ratio); a panel whose metrics were never logged is skipped. Figures are drawn on
matplotlib's Agg canvas directly, without pyplot, so importing this module never switches the
backend of a process that also shows figures.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from grpo_jax.io import run_paths
from grpo_jax.io.metrics import metric_series, read_metrics

# panel file name -> (title, y label, metric names or regexes); raw noisy curves get a moving average.
PANELS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "reward": ("Mean training reward", "reward", ("reward", r"re:rewards/.+/mean")),
    "heldout_accuracy": ("Held-out accuracy", "accuracy", (r"re:eval/(pass@\d+|maj@\d+|greedy_accuracy)",)),
    "kl": ("KL to the reference", "nats / token", ("kl",)),
    "entropy": ("Policy entropy", "nats / token", ("entropy",)),
    "length": ("Completion length", "tokens",
               ("completions/mean_length", "completions/min_length", "completions/max_length")),
    "truncation": ("Truncated completions", "fraction", ("completions/clipped_ratio",)),
    "zero_variance": ("Groups with identical rewards", "fraction", ("frac_reward_zero_std",)),
    "clip_ratio": ("Clipped token fraction", "fraction",
                   ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean",
                    "cispo_clip_ratio", "actor/pg_clipfrac", "actor/pg_clipfrac_lower")),
}


def moving_average(values_N: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to ``window`` values (shorter at the start); same length as the input."""
    if window <= 1 or values_N.size == 0:
        return values_N
    csum = np.cumsum(np.insert(values_N, 0, 0.0))
    idx = np.arange(1, values_N.size + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def _expand(patterns: Sequence[str], names: Sequence[str]) -> list[str]:
    out: list[str] = []
    for p in patterns:
        matches = [n for n in names if re.fullmatch(p[3:], n)] if p.startswith("re:") else [p] if p in names else []
        out.extend(m for m in sorted(matches) if m not in out)
    return out


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None, *, smooth: int = 10) -> list:
    """Writes one PNG per panel that has data; returns the written paths.

    Raises FileNotFoundError (naming the path) when ``run_dir`` or its metrics.jsonl is missing,
    and ValueError when the file holds no metrics at all.
    """
    run_dir = run_paths.as_path(run_dir)  # a local directory or object storage (gs://...)
    records = read_metrics(run_dir)
    names = sorted({k for r in records for k in r if k != "step"})
    if not names:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} holds no metrics to plot")
    out_dir = run_paths.as_path(out_dir) if out_dir is not None else run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)

    written = []
    for file_stem, (title, ylabel, patterns) in PANELS.items():
        series = [(n, *metric_series(records, n)) for n in _expand(patterns, names)]
        series = [(n, s, v) for n, s, v in series if np.isfinite(v).any()]
        if not series:
            continue
        fig = Figure(figsize=(7, 4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for name, steps, values in series:
            ok = np.isfinite(values)
            steps, values = steps[ok], values[ok]
            sparse = values.size < 3 * smooth or name.startswith("eval/")  # eval points: draw as-is
            if sparse:
                ax.plot(steps, values, marker="o", markersize=3, label=name)
            else:  # the seed: "a healthy curve rises noisily... look at a moving average"
                (line,) = ax.plot(steps, values, alpha=0.25)
                ax.plot(steps, moving_average(values, smooth), color=line.get_color(),
                        label=f"{name} (mean of {smooth})")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{file_stem}.png"
        with path.open("wb") as f:
            fig.savefig(f, format="png")
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_jax.io.plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="run directory holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="output directory (default: RUN_DIR/plots)")
    parser.add_argument("--smooth", type=int, default=10, help="moving-average window in steps (default 10)")
    args = parser.parse_args(argv)
    try:
        paths = plot_run(args.run_dir, args.out, smooth=args.smooth)
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"error: {e}\n")
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
