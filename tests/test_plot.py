"""PNG curves from a small synthetic metrics.jsonl; missing metrics skipped; missing inputs are clear errors."""

import json
import subprocess
import sys

import numpy as np
import pytest

from grpo_jax.io.plot import main, moving_average, plot_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir, n_steps=40):
    lines = []
    for s in range(1, n_steps + 1):
        rec = {"step": s, "reward": 0.2 + 0.01 * s, "rewards/correct/mean": 0.1 + 0.01 * s,
               "kl": 0.001 * s, "entropy": 1.0 - 0.01 * s, "completions/mean_length": 100 + s,
               "frac_reward_zero_std": 0.3, "grad_norm": None}  # null: a non-finite value, skipped
        lines.append(json.dumps(rec))
        if s % 10 == 0:
            lines.append(json.dumps({"step": s, "eval/pass@1": 0.1 * s / 10, "eval/pass@8": 0.5}))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_moving_average_is_trailing_and_shorter_at_the_start():
    # [1, 2, 3, 4] with window 2: 1, (1+2)/2, (2+3)/2, (3+4)/2
    np.testing.assert_allclose(moving_average(np.array([1.0, 2.0, 3.0, 4.0]), 2), [1.0, 1.5, 2.5, 3.5])


def test_writes_pngs_for_logged_metrics_and_skips_missing_ones(tmp_path):
    _write_run(tmp_path)
    paths = plot_run(tmp_path)
    names = sorted(p.name for p in paths)
    # No clip-ratio and no truncation metrics were logged, so those panels are skipped.
    assert names == ["entropy.png", "heldout_accuracy.png", "kl.png", "length.png", "reward.png", "zero_variance.png"]
    for p in paths:
        assert p.parent == tmp_path / "plots"
        assert p.read_bytes()[:8] == PNG_MAGIC and len(p.read_bytes()) > 5000


def test_cli_writes_into_out_dir(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "kl": 0.01 * s, "learning_rate": 1e-6}) + "\n" for s in range(1, 21)))
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "figs"), "--smooth", "5"]) == 0
    # learning_rate has no panel; kl is the only plotted metric.
    assert capsys.readouterr().out.split() == [str(tmp_path / "figs" / "kl.png")]


def test_a_run_resumed_after_a_crash_mid_write_still_plots(tmp_path):
    # Killed while writing step 21, resumed from step 20: the old writer glued step 21's new
    # record onto the fragment and `python -m grpo_jax.io.plot` failed on the run from then on.
    from grpo_jax.io.metrics import MetricsWriter
    _write_run(tmp_path, n_steps=20)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 21, "reward": 0.4, "k')
    with MetricsWriter(tmp_path, total_steps=40, report_to=(), console=False) as w:
        for step in range(21, 41):
            w.write(step, {"reward": 0.2 + 0.01 * step, "kl": 0.001 * step})
    out = subprocess.run([sys.executable, "-m", "grpo_jax.io.plot", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "metrics.jsonl:23: skipping a line cut off mid-write" in out.stderr
    assert str(tmp_path / "plots" / "reward.png") in out.stdout.split()


def test_missing_run_dir_or_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_run"):
        plot_run(tmp_path / "no_run")
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="no metrics"):
        plot_run(tmp_path)


def test_module_entry_point_reports_missing_dir_without_a_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "grpo_jax.io.plot", str(tmp_path / "missing")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "error: run directory" in out.stderr and "missing" in out.stderr
    assert "Traceback" not in out.stderr
