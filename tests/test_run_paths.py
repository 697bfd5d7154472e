"""Run directories on object storage: a `gs://` run_dir goes through etils.epath everywhere the
run writes (tested with a gs:// that lives in a local folder; nothing calls the network)."""

import json
import os

import pytest
from fake_gcs import fake_gcs

from grpo_jax import config as config_lib
from grpo_jax.io import run_dir as run_dir_lib
from grpo_jax.io import run_paths
from grpo_jax.io.metrics import MetricsWriter, read_metrics
from grpo_jax.io.plot import plot_run


def test_urls_stay_urls_and_local_paths_become_absolute(tmp_path, monkeypatch):
    # Before: os.path.abspath("gs://YOUR_BUCKET/run") was "<cwd>/gs:/YOUR_BUCKET/run", so every
    # pod worker wrote its checkpoints to its own local disk.
    monkeypatch.chdir(tmp_path)
    assert os.fspath(run_paths.as_path("gs://bucket/grpo/run")) == "gs://bucket/grpo/run"
    assert not run_paths.is_local(run_paths.as_path("gs://bucket/grpo/run"))
    assert os.fspath(run_paths.as_path("runs/a")) == str(tmp_path / "runs" / "a")
    assert os.fspath(run_paths.as_path("file:///tmp/x")) == "/tmp/x"


def test_metrics_config_checks_and_plots_on_a_gs_run_dir(tmp_path):
    with fake_gcs(tmp_path / "gcs"):
        run = "gs://bucket/grpo/run"
        with MetricsWriter(run, total_steps=10, console=False, report_to=("tensorboard",)) as w:
            for step in range(1, 31):
                w.write(step, {"reward": step / 30, "kl": 0.01})
        records = read_metrics(run)
        assert [r["step"] for r in records] == list(range(1, 31))
        # A second run there is refused; config.json is written and compared on resume.
        with pytest.raises(run_dir_lib.RunDirError, match="previous run"):
            run_dir_lib.prepare(config_lib.Config(), run, resume=False, overwrite=False, allow_config_change=False,
                                primary=True)
        run_dir_lib.write_config(config_lib.Config(), run)
        run_dir_lib.prepare(config_lib.Config(), run, resume=True, overwrite=False, allow_config_change=False,
                            primary=True)
        written = plot_run(run)
        assert written and all(os.fspath(p).startswith("gs://bucket/grpo/run/plots/") for p in written)
        # Appending after a reopen (a resumed run) keeps what was there: object stores have no append.
        with MetricsWriter(run, total_steps=40, console=False, report_to=()) as w:
            w.write(31, {"reward": 1.0})
        assert [r["step"] for r in read_metrics(run)] == list(range(1, 32))
    # Everything landed in the bucket's folder, nothing under a "gs:" directory of the cwd.
    bucket = tmp_path / "gcs" / "bucket" / "grpo" / "run"
    assert json.loads((bucket / "config.json").read_text())["train"]["steps"] == 600
    assert (bucket / "metrics.jsonl").is_file() and (bucket / "plots").is_dir()
    assert not (bucket / "tensorboard").exists()  # local event files only: off on object storage


def test_an_unreachable_bucket_or_a_missing_gcsfs_is_one_line_in_bounded_time(tmp_path, monkeypatch):
    # Issue 30: train.run_dir=gs://... without gcsfs, or without a network, took 120 s and 319 lines
    # to fail. No network here: an epath whose exists() never returns stands for the dead endpoint.
    import time

    from etils.epath import testing as epath_testing

    def hang(original, path, *args, **kwargs):
        time.sleep(60)

    with epath_testing.mock_epath(exists=hang):
        t0 = time.perf_counter()
        with pytest.raises(run_dir_lib.RunDirError, match=r"^train.run_dir=gs://bucket/run: no answer from gs:// "
                                                          r"within 0.5 s; check the network"):
            run_dir_lib.check_reachable("gs://bucket/run", timeout_s=0.5)
        assert time.perf_counter() - t0 < 2.0

    def no_gcsfs(original, path, *args, **kwargs):
        raise ImportError("Please install gcsfs to access Google Storage")  # fsspec's own words

    with epath_testing.mock_epath(exists=no_gcsfs):
        with pytest.raises(run_dir_lib.RunDirError) as err:
            run_dir_lib.prepare(config_lib.Config(), "gs://bucket/run", resume=False, overwrite=False,
                                allow_config_change=False, primary=True)
    assert str(err.value) == "train.run_dir=gs://bucket/run needs gcsfs to reach gs:// (pip install 'grpo_jax[gcs]')"
    # The extra exists.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert 'gcs = ["gcsfs' in open(os.path.join(root, "pyproject.toml")).read()
