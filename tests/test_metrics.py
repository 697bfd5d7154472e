"""metrics.jsonl round trip, the console line, samples (random + highest reward), TensorBoard when present."""

import json
import math
import time

import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.io.metrics import MetricsWriter, metric_series, read_metrics


def test_jsonl_round_trip_with_numpy_jax_and_nan(tmp_path):
    with MetricsWriter(tmp_path, total_steps=10, report_to=(), console=False) as w:
        w.write(1, {"reward": 0.25, "kl": np.float32(0.5), "entropy": jnp.asarray(1.5), "grad_norm": float("nan")})
        w.write(2, {"reward": 0.75, "eval/pass@8": 0.786})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    # Strict JSON: NaN is written as null (jq and pandas reject a bare NaN).
    assert json.loads(lines[0]) == {"step": 1, "reward": 0.25, "kl": 0.5, "entropy": 1.5, "grad_norm": None}
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert math.isnan(records[0]["grad_norm"])
    assert records[1] == {"step": 2, "reward": 0.75, "eval/pass@8": 0.786}


def test_resumed_run_appends_and_series_keeps_last_write_per_step(tmp_path):
    with MetricsWriter(tmp_path, total_steps=10, report_to=(), console=False) as w:
        for step in (1, 2, 3):
            w.write(step, {"reward": 0.1 * step})
    # Crash after step 3, resume from a checkpoint at step 2: step 3 is written again.
    with MetricsWriter(tmp_path, total_steps=10, report_to=(), console=False) as w:
        w.write(3, {"reward": 0.9})
        w.write(4, {"reward": 1.0})
    steps, values = metric_series(read_metrics(tmp_path), "reward")
    np.testing.assert_array_equal(steps, [1, 2, 3, 4])
    np.testing.assert_allclose(values, [0.1, 0.2, 0.9, 1.0])
    assert metric_series(read_metrics(tmp_path), "kl")[0].size == 0  # absent metric: empty series


def test_cut_off_last_line_is_skipped_but_bad_middle_line_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew')
    assert read_metrics(tmp_path) == [{"step": 1, "reward": 0.5}]
    path.write_text('{"step": 1, "reward": 0.5}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(tmp_path)


def test_resume_after_a_crash_mid_write_starts_a_new_line_and_reads_back(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew')  # killed while writing step 2
    with caplog.at_level("WARNING", logger="grpo_jax.io.metrics"):
        with MetricsWriter(tmp_path, total_steps=10, report_to=(), console=False) as w:
            w.write(2, {"reward": 0.6})  # resumed from the step-1 checkpoint
            w.write(3, {"reward": 0.7})
    assert "ends in a line cut off mid-write" in caplog.text
    # Old: '{"step": 2, "rew{"step": 2, "reward": 0.6}' on line 2, an error for every reader.
    assert path.read_text().splitlines() == [
        '{"step": 1, "reward": 0.5}', '{"step": 2, "rew', '{"step": 2, "reward": 0.6}', '{"step": 3, "reward": 0.7}']
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpo_jax.io.metrics"):
        records = read_metrics(tmp_path)
    assert [(r["step"], r["reward"]) for r in records] == [(1, 0.5), (2, 0.6), (3, 0.7)]
    assert "metrics.jsonl:2: skipping a line cut off mid-write" in caplog.text
    # A file that ends cleanly gets no extra newline.
    with MetricsWriter(tmp_path, total_steps=10, report_to=(), console=False) as w:
        w.write(4, {"reward": 0.8})
    assert path.read_text().endswith('0.7}\n{"step": 4, "reward": 0.8}\n')
    # samples.jsonl is appended the same way.
    (tmp_path / "samples.jsonl").write_text('{"step": 1, "compl')
    with MetricsWriter(tmp_path, total_steps=10, report_to=(), console=False) as w:
        w.write_samples(2, [{"completion": "x", "reward": 1.0}])
    assert (tmp_path / "samples.jsonl").read_text().splitlines()[0] == '{"step": 1, "compl'


def test_runs_written_before_the_fix_keep_the_record_glued_onto_a_fragment(tmp_path, caplog):
    # What the old writer left after a crash and a resume: fragment + next record on one line
    # (and, after a crash on some file systems, zero bytes where the tail should be).
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "reward": 0.5}\n{"step": 2, "rew{"step": 2, "reward": 0.6}\n'
        '\x00\x00\x00{"step": 3, "reward": 0.7}\n{"step": 4, "reward": 0.8}\n')
    with caplog.at_level("WARNING", logger="grpo_jax.io.metrics"):
        records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[1]["reward"] == 0.6
    assert "metrics.jsonl:2: skipping a fragment" in caplog.text and "metrics.jsonl:3:" in caplog.text


@pytest.mark.parametrize("bad_line", [
    "not json",
    '{"step": 2, "reward": 0.5, }',  # complete but corrupt: not a crash
    '{"step": "2", "reward": 0.5}',  # a record without an integer step
    '{"reward": 0.5}{"step": 3}',  # glued onto something that is not a cut-off record
    '{"step": 2, "re\xe9ward": 0.5}',  # a stray byte
])
def test_corrupt_middle_lines_are_errors_naming_file_and_line(tmp_path, bad_line):
    (tmp_path / "metrics.jsonl").write_bytes(
        b'{"step": 1}\n' + bad_line.encode("latin-1") + b'\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a metrics record"):
        read_metrics(tmp_path)


def test_missing_run_dir_or_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        read_metrics(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path)


def test_bad_metric_values_name_the_metric(tmp_path):
    with MetricsWriter(tmp_path, total_steps=10, report_to=(), console=False) as w:
        with pytest.raises(TypeError, match="'reward'"):
            w.write(1, {"reward": np.ones(3)})
        with pytest.raises(ValueError, match=r"metrics\['step'\] = 3 differs from the step argument 1"):
            w.write(1, {"step": 3})
        w.write(2, {"step": 2, "reward": 1.0})  # a repeated step key is fine
    assert read_metrics(tmp_path) == [{"step": 2, "reward": 1.0}]


def test_progress_line_shows_key_figures_bar_and_eta(tmp_path, monkeypatch, capsys):
    clock = iter([100.0, 104.0])  # 2 steps in 4 s -> 2 s/step; 96 steps left -> 192 s
    monkeypatch.setattr("grpo_jax.io.metrics.time.monotonic", lambda: next(clock))
    with MetricsWriter(tmp_path, total_steps=100, report_to=()) as w:
        w.write(2, {"reward": 0.5, "kl": 0.0031, "entropy": 0.9, "completions/mean_length": 181.0, "lr": 1e-6})
        w.write(4, {"reward": 0.6, "kl": 0.004, "entropy": 0.8, "completions/mean_length": 190.0})
    first, second = capsys.readouterr().out.strip().splitlines()
    assert first.startswith("step   2/100 [--------------------]   2%")
    assert "reward 0.5 kl 0.0031 entropy 0.9 len 181" in first and "lr" not in first
    assert "[#-------------------]   4%" in second
    assert second.endswith("2.00 s/step ETA 3m12s")


def test_samples_print_random_and_top_reward_and_keep_all(tmp_path, capsys):
    samples = [
        {"prompt": f"Q{i}", "completion": f"answer text {i}", "reward": 0.0, "rewards": {"correct": 0.0}, "answer": "7"}
        for i in range(20)
    ]
    samples[13]["reward"] = 1.5  # the one a hack would show up as
    samples[13]["completion"] = "\\boxed{7} \\boxed{8}"
    with MetricsWriter(tmp_path, total_steps=10, report_to=()) as w:
        w.write_samples(5, samples, n_random=5, n_top=1)
    out = capsys.readouterr().out
    assert "samples at step 5: 20 completions" in out
    assert out.count("[#") == 6  # 5 random + 1 top (13 is not among the random ones for seed 5)
    top_section = out.split("highest reward")[1]
    assert "[#13] reward=1.5 (rewards/correct=0.0) | reference answer: 7" in top_section
    stored = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(stored) == 20  # every sample is kept, not only the printed ones
    assert [s["shown"] for s in stored].count("random") == 5
    assert stored[13]["shown"] == "top" and stored[13]["step"] == 5


def test_long_completion_is_cut_in_the_middle(tmp_path, capsys):
    text = "A" * 1000 + "B" * 1000
    with MetricsWriter(tmp_path, total_steps=10, report_to=()) as w:
        w.write_samples(1, [{"completion": text, "reward": 1.0}], max_chars=100)
    out = capsys.readouterr().out
    assert "A" * 50 + "\n  [... 1900 chars cut ...]\n" + "B" * 50 in out


def test_samples_missing_fields_is_a_clear_error(tmp_path):
    with MetricsWriter(tmp_path, total_steps=10, report_to=(), console=False) as w:
        with pytest.raises(ValueError, match=r"samples\[1\].*'completion' and 'reward'"):
            w.write_samples(1, [{"completion": "a", "reward": 1}, {"text": "b"}])


def _event_scalars(log_dir):
    """(tag, value, step) of every scalar in a TensorBoard event file (TFRecord of Event protos)."""
    import struct

    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(log_dir.iterdir()):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            out += [(v.tag, v.simple_value, event.step) for v in event.summary.value]
    return out


def test_tensorboard_tags_are_the_metric_names(tmp_path, caplog):
    # Before: tensorboardX renamed eval/pass@1 to eval/pass_1 (with an "illegal name" line per
    # evaluation), so TensorBoard and the README disagreed. One name everywhere now.
    pytest.importorskip("tensorboardX")
    with caplog.at_level("INFO"):
        with MetricsWriter(tmp_path, total_steps=10, console=False, report_to=("tensorboard",)) as w:
            w.write(3, {"eval/pass@1": 0.25, "reward": 0.5})
    scalars = _event_scalars(tmp_path / "tensorboard")
    assert ("eval/pass@1", 0.25, 3) in scalars and ("reward", 0.5, 3) in scalars
    assert "illegal" not in caplog.text.lower()


def test_wandb_offline_gets_the_same_names(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with MetricsWriter(tmp_path, total_steps=10, console=False, report_to=("wandb",)) as w:
        w.write(1, {"eval/pass@1": 0.25, "reward": 0.5})
    assert wandb.run is None  # finished on close
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")  # the run, written without a network
    # wandb's service process may still be writing the file when finish() returns (a loaded CI
    # machine once read only its header): wait for the record, up to a minute.
    deadline = time.monotonic() + 60
    while b"eval/pass@1" not in log.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"eval/pass@1" in log.read_bytes()  # the key as metrics.jsonl spells it
