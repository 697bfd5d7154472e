"""A run directory is one run's: reusing it needs --resume (the config compared with the run's) or
--overwrite; nothing of the old run is lost without one of them."""

import dataclasses
import json
import logging
import os

import pytest

from grpo_jax import config as config_lib
from grpo_jax.io import run_dir as run_dir_lib
from grpo_jax.training import train
from grpo_jax.io.run_dir import RunDirError
from test_train import SevensTask, tiny_config


def _finished_run(tmp_path, steps=2):
    cfg = tiny_config(tmp_path)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
    train.run(cfg, task=SevensTask())
    return cfg


def test_starting_over_a_previous_run_is_refused_and_deletes_nothing(tmp_path):
    # Before: the second start deleted the first run's checkpoints (rotated out by keep_checkpoints)
    # and appended its rows to the same metrics.jsonl, without a word.
    cfg = _finished_run(tmp_path)
    before = sorted(os.listdir(tmp_path / "checkpoints"))
    metrics = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(RunDirError, match=r"previous run \(checkpoints at steps \[1, 2\].*--resume.*--overwrite"):
        train.run(cfg, task=SevensTask())
    assert sorted(os.listdir(tmp_path / "checkpoints")) == before
    assert (tmp_path / "metrics.jsonl").read_text() == metrics


def test_overwrite_replaces_the_previous_run(tmp_path):
    cfg = _finished_run(tmp_path)
    result = train.run(cfg, task=SevensTask(), overwrite=True)
    assert result.step == 2
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]  # only the new run's rows


def test_resume_refuses_a_config_that_changes_the_run_and_names_the_fields(tmp_path):
    cfg = _finished_run(tmp_path)
    saved = (tmp_path / "config.json").read_text()
    changed = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, num_generations=2),
                                  train=dataclasses.replace(cfg.train, seed=4, steps=3))
    with pytest.raises(RunDirError) as err:
        train.run(changed, task=SevensTask(), resume=True)
    message = str(err.value)
    for line in ("grpo.num_generations: 4 -> 2", "train.seed: 3 -> 4", "--allow-config-change"):
        assert line in message, message
    assert (tmp_path / "config.json").read_text() == saved  # not rewritten by a start that failed


def test_resume_accepts_operational_changes_and_logs_them(tmp_path, caplog):
    cfg = _finished_run(tmp_path)
    more = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=3))
    # A longer run under a cosine schedule changes the learning rate of the steps to come: refused,
    # saying why (before: refused under every schedule, even where nothing trained changes).
    cosine = dataclasses.replace(more, optim=dataclasses.replace(more.optim, schedule="cosine"))
    with pytest.raises(RunDirError, match=r"train.steps: 2 -> 3 \(optim.schedule='cosine' decays over train.steps"):
        run_dir_lib.check_resumed_config(cosine, tmp_path, allow_config_change=False)
    # With the run's constant schedule it changes nothing already trained: accepted and said so,
    # as evaluation and logging cadence are.
    relaxed = dataclasses.replace(more, train=dataclasses.replace(more.train, log_every=2, samples_every=1))
    with caplog.at_level(logging.INFO, logger="grpo_jax"):
        result = train.run(relaxed, task=SevensTask(), resume=True)
    assert result.step == 3
    text = caplog.text
    assert "train.log_every changed 1 -> 2" in text
    assert "train.steps 2 -> 3: optim.schedule='constant', so the learning rate of every step" in text
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 3


def test_a_run_saved_with_the_old_loss_defaults_resumes_without_a_config_change():
    # grpo.aggregation and grpo.ratio defaulted to "sequence" and "token" before grpo.loss_type;
    # now None means the loss_type's (the same two without one). What the update runs is compared.
    saved = config_lib.to_dict(config_lib.Config())
    saved["grpo"].update(aggregation="sequence", ratio="token")
    saved["grpo"].pop("loss_type")
    assert run_dir_lib.config_differences(saved, config_lib.to_dict(config_lib.Config())) == []
    # A real change still shows, as what runs: DAPO's token aggregation against the seed's.
    dapo = config_lib.apply_overrides(config_lib.Config(), ["grpo.loss_type=dapo"])
    assert sorted(run_dir_lib.config_differences(saved, config_lib.to_dict(dapo))) == [
        ("grpo.aggregation", "sequence", "token"), ("grpo.loss_type", None, "dapo")]


def test_config_differences_cover_task_options_and_tuples():
    a = config_lib.to_dict(config_lib.Config())
    b = config_lib.to_dict(config_lib.apply_overrides(config_lib.Config(), ["task.options.digits=3",
                                                                            "eval.ks=[1, 4]"]))
    a = json.loads(json.dumps(a))  # as read back from config.json: tuples become lists
    diffs = run_dir_lib.config_differences(a, b)
    assert ("task.options.digits", None, 3) in diffs
    assert ("eval.ks", [1, 8], [1, 4]) in diffs
    assert run_dir_lib.is_operational("eval.ks") and not run_dir_lib.is_operational("task.options.digits")
    with pytest.raises(RunDirError, match="contradict"):
        run_dir_lib.prepare(config_lib.Config(), "/nonexistent", resume=True, overwrite=True,
                            allow_config_change=False, primary=True)


def test_resume_after_the_final_save_keeps_the_summary_table(tmp_path, monkeypatch):
    # Before: `--resume` of a finished run rewrote summary.md as "(no held-out evaluation ran)".
    from grpo_jax.cli import report
    from grpo_jax.config import EvalSection

    run = train.run
    monkeypatch.setattr(report.train, "run", lambda config, **kw: run(config, task=SevensTask(), **kw))
    cfg = dataclasses.replace(tiny_config(tmp_path), eval=EvalSection(every=0, num_questions=4, num_samples=2,
                                                                      ks=(1, 2)))
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=2))
    report.run_and_report(cfg)
    first = (tmp_path / "summary.md").read_text()
    assert "| held-out metric | step 0 | step 2 |" in first
    result = report.run_and_report(cfg, resume=True)
    assert result.step == 2 and not result.history  # nothing left to train
    assert (tmp_path / "summary.md").read_text() == first


def _unwritable_dir(tmp_path):
    """A directory this process cannot create files in: mode 0500 for a normal user; as root
    (which ignores modes) /sys, a read-only place in most containers, else None."""
    import tempfile

    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        return locked
    try:
        with tempfile.TemporaryFile(dir="/sys"):
            return None
    except OSError:
        return "/sys"


def test_a_run_dir_that_is_a_file_or_unwritable_is_one_line_before_anything_runs(tmp_path):
    # Issue 30: 21-33-line tracebacks at the first write (after the model was built). Now one
    # RunDirError line from `prepare`, which the CLI prints with exit status 2.
    import subprocess
    import sys

    file = tmp_path / "a_file"
    file.write_text("x")
    with pytest.raises(RunDirError, match=f"^train.run_dir={file} is a file, not a directory; set train.run_dir"):
        train.run(tiny_config(file), task=SevensTask())
    with pytest.raises(RunDirError, match=f"^train.run_dir={file / 'run'} is inside {file}, which is a file"):
        train.run(tiny_config(file / "run"), task=SevensTask())
    locked = _unwritable_dir(tmp_path)
    if locked is not None:
        with pytest.raises(RunDirError, match=f"^train.run_dir={locked}/run: cannot create files in {locked} "
                                              r"\(Permission denied\); choose a writable directory"):
            train.run(tiny_config(f"{locked}/run"), task=SevensTask())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "grpo_jax", "train", "--config", "configs/arith_cpu.py",
                           "--set", f"train.run_dir={file}"], capture_output=True, text=True, cwd=root, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (f"run directory error: train.run_dir={file} is a file, not a "
                                                    "directory; set train.run_dir to a directory path")
    assert "Traceback" not in proc.stderr


def test_a_changed_model_shape_is_refused_on_resume_even_with_allow_config_change(tmp_path):
    # Issue 30: `--resume --allow-config-change` with a new model.hidden_size tried every checkpoint
    # (each failed on the shapes), then stopped with a 27-line traceback, exit 1, and printed asyncio's
    # "exception was never retrieved" blocks. Now one line, exit 2, before anything is built.
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = [sys.executable, "-m", "grpo_jax", "train", "--config", "configs/arith_cpu.py", "--set",
            f"train.run_dir={tmp_path}", "--set", "train.steps=4", "--set", "train.checkpoint_every=1", "--set",
            "eval.every=0", "--set", "sft.steps=0", "--set", "eval.num_questions=0"]  # no warm-up: seconds, not a minute
    first = subprocess.run(base + ["--set", "train.stop_after_steps=1"], capture_output=True, text=True,
                           cwd=root, timeout=600)
    assert first.returncode == 75, first.stderr[-2000:]
    proc = subprocess.run(base + ["--set", "model.hidden_size=64", "--resume", "--allow-config-change"],
                          capture_output=True, text=True, cwd=root, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "run directory error: --resume: model.hidden_size changed 128 -> 64, and it sets what the run's checkpoints "
        "hold (the shapes of the saved weights and Adam state); resume with model.hidden_size=128, or start a new "
        "train.run_dir")
    assert "Traceback" not in proc.stderr and "never retrieved" not in proc.stderr
