"""The run directory before a run touches it: is it a previous run's, may this run use it, and has
the config changed since that run started.

A run directory holds one run's checkpoints, metrics.jsonl, samples and config.json. Starting a new
run there without `--resume` would let the new run's checkpoints rotate out the old run's and mix
both runs' rows in metrics.jsonl, so it is refused unless `--overwrite` says to replace it.
`--resume` compares the saved config.json with the new config: fields that change what the run
means refuse (with the list of differences) unless `--allow-config-change`; operational ones
(evaluation cadence, logging, checkpoint cadence, workers, the mesh) are accepted and logged.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
import logging
from typing import Any

from grpo_jax import config as config_lib
from grpo_jax.io import run_paths

log = logging.getLogger("grpo_jax")

CONFIG_FILE = "config.json"
# What a run writes into its directory (train.py, metrics.py, report.py, plot.py).
RUN_FILES = ("checkpoints", "metrics.jsonl", "samples.jsonl", "tensorboard", "plots", "summary.md", "sft.json",
             "hf", CONFIG_FILE)

# Config fields (or whole sections) that may change on --resume without changing what the run
# computes: how often it evaluates, logs and saves, where it runs and with how many workers. Every
# other field (model shape, task and its options, G, seed, steps and the schedule, every GRPO and
# optimizer setting) changes the run's meaning.
OPERATIONAL_FIELDS = (
    "eval.",
    "model.chat_template_max_seconds",
    "model.chat_template_max_chars",
    "mesh.",
    "sampling.threads",
    "sampling.vllm_server_host",  # a restarted vLLM server may listen elsewhere (server mode)
    "sampling.vllm_server_port",
    "sampling.vllm_server_timeout",
    "train.run_dir",
    "train.log_every",
    "train.samples_every",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.async_checkpoints",
    "train.stop_after_steps",
    "train.export_hf",
    "train.export_peft",
    "rewards.workers",
    "rewards.timeout_s",
    "train.max_nonfinite_steps",
    "train.progress",
    "train.report_to",
    "train.wandb_project",
)


# Fields that set what a checkpoint holds: a changed value cannot restore it (even with
# --allow-config-change), and trying would set the good checkpoints aside as corrupt.
CHECKPOINT_LAYOUT_FIELDS = ("off_policy.max_staleness", "model.vocab_size", "model.hidden_size",
                            "model.intermediate_size", "model.num_layers", "model.num_heads", "model.num_kv_heads",
                            "model.head_dim", "model.tie_embeddings", "model.qkv_bias", "model.qk_norm",
                            "lora.r", "lora.target_modules")
_LAYOUT_WHAT = {"off_policy.max_staleness": "the parameter snapshots of in-flight rollouts"}


class RunDirError(ValueError):
    """The run directory cannot be used as asked; the message says what would work."""


def previous_run(run_dir) -> list[str]:
    """What in `run_dir` (local or object storage) belongs to an earlier run (empty for a new or
    empty directory)."""
    run_dir = run_paths.as_path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    ckpt = run_dir / "checkpoints"
    if ckpt.is_dir():
        steps = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
        if steps:
            found.append(f"checkpoints at steps {steps}")
    for name in ("metrics.jsonl", "samples.jsonl"):
        path = run_dir / name
        if path.is_file() and path.stat().length > 0:
            found.append(name)
    return found


def config_differences(saved: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """(section.field, saved value, new value) for every field that differs, in config order;
    task options as "task.options.<name>"."""
    diffs = []
    defaults = config_lib.to_dict(config_lib.Config())
    for section in new:
        # A field the saved config lacks was added later: that run ran with its default.
        old_sec, new_sec = {**defaults.get(section, {}), **saved.get(section, {})}, new[section]
        if section == "grpo":  # aggregation/ratio None mean the loss_type's: compare what runs
            old_sec, new_sec = _resolved_loss(old_sec), _resolved_loss(new_sec)
        for field in new_sec:
            if section == "task" and field == "options":
                old_opts, new_opts = old_sec.get("options", {}), new_sec["options"]
                for name in sorted(set(old_opts) | set(new_opts)):
                    if old_opts.get(name) != new_opts.get(name):
                        diffs.append((f"task.options.{name}", old_opts.get(name), new_opts.get(name)))
                continue
            old, value = old_sec.get(field), new_sec[field]
            if isinstance(value, tuple):
                value = list(value)
            if isinstance(old, tuple):
                old = list(old)
            if old != value:
                diffs.append((f"{section}.{field}", old, value))
    return diffs


def _resolved_loss(grpo: dict) -> dict:
    """`grpo` (a config section as a dict) with aggregation and ratio as the update runs them: a run
    saved with `aggregation="sequence"` (the old default) and one with None and no loss_type are one run."""
    try:
        _, aggregation, ratio = config_lib.GRPOSection(
            loss_type=grpo.get("loss_type"), aggregation=grpo.get("aggregation"), ratio=grpo.get("ratio")).resolved_loss()
    except (TypeError, ValueError):  # a conflict is validate()'s to report
        return grpo
    return {**grpo, "aggregation": aggregation, "ratio": ratio}


def is_operational(key: str) -> bool:
    return any(key == f or (f.endswith(".") and key.startswith(f)) for f in OPERATIONAL_FIELDS)


def prepare(config: config_lib.Config, run_dir, *, resume: bool, overwrite: bool,
            allow_config_change: bool, primary: bool) -> None:
    """Checks `run_dir` for this run (RunDirError naming what to do), and with `overwrite` removes
    the previous run's files. Nothing is written here (a local run_dir is probed for writing with a
    temporary file); config.json is written by the caller once
    the run has started from its state."""
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite contradict each other: continue the run, or replace it")
    if primary and run_paths.is_local(run_dir):
        check_writable(run_dir)
    elif not run_paths.is_local(run_paths.as_path(run_dir)):
        check_reachable(run_dir)
    found = previous_run(run_dir)
    if found and not resume:
        if not overwrite:
            raise RunDirError(
                f"{run_dir} holds a previous run ({', '.join(found)}); starting there would delete its "
                "checkpoints and mix both runs' metrics. Pass --resume to continue it, --overwrite to replace "
                "it, or set train.run_dir to a new directory"
            )
        if primary:
            for name in RUN_FILES:
                path = run_paths.as_path(run_dir) / name
                if path.is_dir():
                    path.rmtree()
                elif path.exists():
                    path.unlink()
            log.warning("--overwrite: removed the previous run in %s (%s)", run_dir, ", ".join(found))
    if resume:
        check_resumed_config(config, run_dir, allow_config_change=allow_config_change)


def check_writable(run_dir) -> None:
    """A local run_dir (or, before it exists, its nearest existing parent) must be a directory this
    process can create files in: otherwise one RunDirError line now, not a traceback at the first
    write. Probed with a temporary file that is removed at once (permissions alone do not say:
    root ignores them, a read-only mount does not)."""
    path = pathlib.Path(os.fspath(run_dir)).absolute()
    probe_dir = path
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        which = "is a file" if probe_dir == path else f"is inside {probe_dir}, which is a file"
        raise RunDirError(f"train.run_dir={run_dir} {which}, not a directory; set train.run_dir to a directory path")
    try:
        with tempfile.TemporaryFile(dir=probe_dir):
            pass
    except OSError as e:
        raise RunDirError(f"train.run_dir={run_dir}: cannot create files in {probe_dir} ({e.strerror}); choose a "
                          "writable directory or fix its permissions") from None


# Object-storage schemes and the fsspec package etils.epath reads them with (pip extras of grpo_jax).
_STORAGE_PACKAGES = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", None)}
STORAGE_PROBE_S = 30.0  # gcsfs alone retries an unreachable endpoint for ~120 s before it gives up


def check_reachable(run_dir, timeout_s: float = STORAGE_PROBE_S) -> None:
    """An object-storage run_dir: one look at it (does it exist?) within `timeout_s`, in a daemon
    thread, so that a missing client package or an unreachable bucket is one RunDirError line in
    seconds, not 120 s of retries and 300 lines of tracebacks."""
    import threading

    path = run_paths.as_path(run_dir)
    scheme = os.fspath(path).split("://", 1)[0]
    result: dict[str, Any] = {}

    def look():
        try:
            result["exists"] = path.exists()
        except BaseException as e:  # noqa: BLE001 - reported below, in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=look, name="grpo_jax storage probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RunDirError(f"train.run_dir={run_dir}: no answer from {scheme}:// within {timeout_s:g} s; check the "
                          "network, the bucket's name and your credentials (gcloud auth application-default login)")
    error = result.get("error")
    if isinstance(error, ImportError):
        package, extra = _STORAGE_PACKAGES.get(scheme, ("an fsspec backend", None))
        how = f"pip install 'grpo_jax[{extra}]'" if extra else f"pip install {package}"
        raise RunDirError(f"train.run_dir={run_dir} needs {package} to reach {scheme}:// ({how})")
    if error is not None:
        first = (str(error).strip().splitlines() or [""])[0][:300]
        raise RunDirError(f"train.run_dir={run_dir}: cannot reach it ({type(error).__name__}: {first}); check the "
                          "bucket's name, your credentials and the network")


def check_resumed_config(config: config_lib.Config, run_dir, *, allow_config_change: bool) -> None:
    """Compares run_dir/config.json (the run's config when it started) with `config`."""
    path = run_paths.as_path(run_dir) / CONFIG_FILE
    if not path.is_file():
        if previous_run(run_dir):
            log.warning("--resume: %s has no %s; the config cannot be compared with the run's", run_dir, CONFIG_FILE)
        return
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunDirError(f"{path}: cannot read the run's config ({e}); fix or remove the file to resume") from None
    saved = config_lib.upgrade_saved(saved, str(path))  # a run saved before the sections were regrouped
    diffs = config_differences(saved, config_lib.to_dict(config))
    # (A config written before the field existed ran with its default, 0.)
    # The model.* shape fields are ignored when a checkpoint (model.hf_path) gives the shape.
    from_hf = bool(config.model.hf_path) and bool(saved.get("model", {}).get("hf_path"))
    layout = [d for d in diffs if d[0] in CHECKPOINT_LAYOUT_FIELDS and (d[1] or 0) != d[2]
              and not (from_hf and d[0].startswith("model."))]
    if layout:
        key, old, new = layout[0]
        raise RunDirError(
            f"--resume: {key} changed {old!r} -> {new!r}, and it sets what the run's checkpoints hold (the "
            f"{_LAYOUT_WHAT.get(key, 'shapes of the saved weights and Adam state')}); resume with {key}={old!r}, or "
            "start a new train.run_dir")
    extended = [d for d in diffs if _extends_the_run(d, config)]
    for key, old, new in extended:
        log.info("--resume: train.steps %r -> %r: optim.schedule='constant', so the learning rate of every step "
                 "(warm-up included) is the one it had; the run goes on to step %d", old, new, new)
    meaningful = [d for d in diffs if not is_operational(d[0]) and d not in extended]
    for key, old, new in diffs:
        if is_operational(key):
            log.info("--resume: %s changed %r -> %r (does not change what the run computes)", key, old, new)
    if meaningful and not allow_config_change:
        lines = "\n".join(f"  {key}: {old!r} -> {new!r}{_why(key, old, new, config)}" for key, old, new in meaningful)
        raise RunDirError(
            f"--resume: the config differs from the run's ({path}) in fields that change what the run means:\n"
            f"{lines}\nUse the run's values, start a new train.run_dir, or pass --allow-config-change to resume "
            "with these changes anyway"
        )
    for key, old, new in meaningful:
        log.warning("--resume --allow-config-change: %s %r -> %r", key, old, new)


def _extends_the_run(diff: tuple[str, Any, Any], config: config_lib.Config) -> bool:
    """Raising train.steps under a constant schedule changes nothing already trained: the learning
    rate (warm-up, then constant) does not depend on the run's length, and nothing else does."""
    key, old, new = diff
    return (key == "train.steps" and isinstance(old, int) and isinstance(new, int) and new > old
            and config.optim.schedule == "constant")


def _why(key: str, old: Any, new: Any, config: config_lib.Config) -> str:
    """What a refused change would change, where a line says it better than the field's name."""
    if key == "train.steps" and config.optim.schedule == "cosine":
        return (" (optim.schedule='cosine' decays over train.steps: the learning rate of the steps to come "
                "changes; raising train.steps is accepted with schedule='constant')")
    return ""


def write_config(config: config_lib.Config, run_dir) -> None:
    """config.json: the config this run (or resumed run) runs with (written whole, then renamed
    into place on a local disk; one object write on object storage)."""
    path = run_paths.as_path(run_dir) / CONFIG_FILE
    text = json.dumps(config_lib.to_dict(config), indent=2)
    if not run_paths.is_local(path):
        path.write_text(text, encoding="utf-8")
        return
    tmp = path.parent / (path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
