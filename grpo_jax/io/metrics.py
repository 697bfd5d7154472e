"""Metrics out: ``run_dir/metrics.jsonl``, TensorBoard (when installed), a console progress line, samples.

Seed Part 1's "most important habit": print about 5 real samples every N steps and read them;
Part 2's defence 5: read the highest-reward samples, because hacks show up there first. So
``write_samples`` prints a few random samples and the top-reward ones, and keeps all of them in
``run_dir/samples.jsonl``.

Only process 0 writes anything, so a multi-host run produces one set of files.
"""

from __future__ import annotations

import json
import logging
import math
import random
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from grpo_jax.io import run_paths, scalar_sinks

import numpy as np

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"

# Short console names for the key metrics; anything else prints under its own name.
_SHORT_NAMES = {"completions/mean_length": "len", "frac_reward_zero_std": "zero_std",
                "completions/clipped_ratio": "trunc", "clip_ratio/region_mean": "clip"}


def _to_float(name: str, value: Any) -> float:
    """A Python float from a Python/numpy/jax scalar; errors name the metric."""
    try:
        arr = np.asarray(value)
    except Exception as e:  # noqa: BLE001
        raise TypeError(f"metric {name!r}: cannot convert {type(value).__name__} to a number") from e
    if arr.size != 1 or arr.dtype.kind not in "biuf":
        raise TypeError(f"metric {name!r} must be a real scalar, got dtype {arr.dtype} shape {arr.shape}")
    return float(arr.reshape(()))


def _json_number(x: float) -> float | None:
    # Strict JSON has no NaN/Infinity (jq, pandas and browsers reject them): write null instead;
    # read_metrics turns null back into NaN.
    return x if math.isfinite(x) else None


def _jsonable(value: Any) -> Any:
    """Samples may hold numpy/jax scalars or arrays; JSON gets plain Python values."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, bool)) or value is None:
        return value
    if isinstance(value, (int, float, np.generic)) or hasattr(value, "__array__"):  # numpy or jax arrays
        arr = np.asarray(value)
        if arr.ndim == 0:
            out = arr.item()
            return _json_number(out) if isinstance(out, float) else out
        return [_jsonable(v) for v in arr.tolist()]
    return str(value)


def _open_append(path):
    """A JSON-lines file to append to (local or object storage: `run_paths.open_lines`), first
    ending a line that a crash cut off mid-write.

    Without the newline, a resumed run's first record would be glued onto the fragment and the
    line would be lost for every reader (``{"step": 2, "rew{"step": 2, "reward": 0.6}``).
    """
    fh = run_paths.open_lines(path)
    if not fh.ends_with_newline():
        log.warning("%s ends in a line cut off mid-write (a crash); appending from a new line, "
                    "readers skip the fragment", path)
        fh.write("\n")
    return fh


def _format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class MetricsWriter:
    """Writes one record per ``write`` call to metrics.jsonl, the ``report_to`` sinks
    (TensorBoard, Weights & Biases: `grpo_jax.io.scalar_sinks`) and the console.

    The console line (one per call, so it reads the same in a terminal and in a log file)::

        step   40/200 [####----------------]  20% | reward 0.425 kl 0.0031 entropy 0.912 len 181.0 | 2.1 s/step ETA 5m36s

    ETA uses the wall time since this writer's first ``write``, so a resumed run estimates
    from its own speed, not from the steps done before the restart.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        total_steps: int,
        report_to: Sequence[str] = ("tensorboard",),
        console: bool = True,
        wandb_project: str = "grpo_jax",
        run_config: dict | None = None,
        key_metrics: Sequence[str] = ("reward", "kl", "entropy", "completions/mean_length"),
    ):
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        self.run_dir = run_paths.as_path(run_dir)
        self.total_steps = total_steps
        self.console = console
        self.key_metrics = tuple(key_metrics)
        import jax  # here, not at the top: `python -m grpo_jax.io.plot` reads metrics without loading jax

        self._primary = jax.process_index() == 0
        self._metrics_fh = None
        self._samples_fh = None
        self._sinks = []
        self._t0: float | None = None
        self._step0: int | None = None
        if not self._primary:
            return
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise NotADirectoryError(f"run_dir {self.run_dir} exists but is a file; pass a directory")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Append: a resumed run continues the same file. Readers keep the last value per step.
        self._metrics_fh = _open_append(self.run_dir / METRICS_FILE)
        self._sinks = scalar_sinks.open_sinks(report_to, self.run_dir, wandb_project=wandb_project, config=run_config)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        """Appends ``{"step": step, **metrics}`` as one JSON line, logs scalars, prints the progress line."""
        if not self._primary:
            return
        values = {name: _to_float(name, v) for name, v in metrics.items()}
        if "step" in values:  # tolerated when it repeats the step argument
            if values.pop("step") != step:
                raise ValueError(f"metrics['step'] = {metrics['step']} differs from the step argument {step}")
        record = {"step": int(step), **{k: _json_number(v) for k, v in values.items()}}
        self._metrics_fh.write(json.dumps(record, allow_nan=False) + "\n")
        self._metrics_fh.flush()  # a crash loses at most the line being written
        for sink in self._sinks:
            sink.write(int(step), values)
        if self.console:
            print(self.progress_line(int(step), values), flush=True)

    def progress_line(self, step: int, values: Mapping[str, float]) -> str:
        """The console line for ``step``; also updates the ETA clock."""
        now = time.monotonic()
        if self._t0 is None:
            self._t0, self._step0 = now, step
        frac = min(max(step / self.total_steps, 0.0), 1.0)
        width = 20
        filled = int(round(frac * width))
        parts = [f"step {step:>{len(str(self.total_steps))}}/{self.total_steps} "
                 f"[{'#' * filled}{'-' * (width - filled)}] {frac:4.0%}"]
        shown = [f"{_SHORT_NAMES.get(k, k)} {values[k]:.4g}" for k in self.key_metrics if k in values]
        if shown:
            parts.append(" ".join(shown))
        done = step - self._step0
        if done > 0:
            per_step = (now - self._t0) / done
            remaining = max(self.total_steps - step, 0) * per_step
            parts.append(f"{per_step:.2f} s/step ETA {_format_duration(remaining)}")
        return " | ".join(parts)

    def write_samples(
        self, step: int, samples: list[dict], *, n_random: int = 5, n_top: int = 3, max_chars: int = 1500
    ) -> None:
        """Prints ``n_random`` random samples and the ``n_top`` highest-reward ones; keeps all in samples.jsonl.

        samples: dicts with at least "completion" and "reward"; "prompt", "answer" and per-function
          rewards (any other numeric or dict-of-numbers field, e.g. {"rewards": {"correct": 1.0}})
          are printed too. Each stored line is the sample plus "step" and "shown" ("random", "top"
          or null). Printed texts longer than ``max_chars`` keep their head and tail.
        """
        if not self._primary or not samples:
            return
        for i, s in enumerate(samples):
            if not isinstance(s, Mapping) or "completion" not in s or "reward" not in s:
                got = sorted(s) if isinstance(s, Mapping) else type(s).__name__
                raise ValueError(f"samples[{i}] must be a dict with 'completion' and 'reward'; got {got}")
        rng = random.Random(step)  # the same step shows the same samples when re-run
        order = list(range(len(samples)))
        random_idx = sorted(rng.sample(order, min(n_random, len(samples))))
        by_reward = sorted(order, key=lambda i: -_to_float(f"samples[{i}].reward", samples[i]["reward"]))
        top_idx = [i for i in by_reward if i not in random_idx][:n_top]
        shown = {**{i: "random" for i in random_idx}, **{i: "top" for i in top_idx}}

        if self._samples_fh is None:
            self._samples_fh = _open_append(self.run_dir / SAMPLES_FILE)
        for i, s in enumerate(samples):
            record = {"step": int(step), "shown": shown.get(i), **_jsonable(dict(s))}
            self._samples_fh.write(json.dumps(record, allow_nan=False) + "\n")
        self._samples_fh.flush()

        if self.console:
            rewards = [_to_float("reward", s["reward"]) for s in samples]
            lines = [f"===== samples at step {step}: {len(samples)} completions, "
                     f"mean reward {np.mean(rewards):.3f}, max {np.max(rewards):.3f} ====="]
            for label, idx in (("random", random_idx), ("highest reward (read these for hacks)", top_idx)):
                if idx:
                    lines.append(f"--- {label} ---")
                    lines.extend(_format_sample(j, samples[j], max_chars) for j in idx)
            print("\n".join(lines), file=sys.stdout, flush=True)

    def close(self) -> None:
        for fh in (self._metrics_fh, self._samples_fh):
            if fh is not None:
                fh.close()
        self._metrics_fh = self._samples_fh = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _clip_text(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n  [... {len(text) - 2 * half} chars cut ...]\n{text[-half:]}"


def _format_sample(index: int, sample: Mapping[str, Any], max_chars: int) -> str:
    labelled = ("prompt", "completion", "answer", "reference", "extracted_answer", "stop", "reward")
    extras = []
    for key, value in sample.items():
        if key in labelled:
            continue
        if isinstance(value, Mapping):
            extras.extend(f"{key}/{k}={_jsonable(v)}" for k, v in value.items())
        elif (isinstance(value, (int, float, np.generic)) or hasattr(value, "__array__")) and not isinstance(value, bool):
            extras.append(f"{key}={_jsonable(value)}")
    head = f"[#{index}] reward={_jsonable(sample['reward'])}"
    if extras:
        head += " (" + ", ".join(extras) + ")"
    reference = sample.get("reference", sample.get("answer"))
    answers = []
    if "reference" in sample or "answer" in sample:
        answers.append(f"reference answer: {reference}")
    if "extracted_answer" in sample:
        answers.append(f"model's answer: {sample['extracted_answer']}")
    if answers:
        head += " | " + " | ".join(answers)
    body = []
    if "prompt" in sample:
        body.append("prompt (as the model saw it): " + _clip_text(str(sample["prompt"]), max_chars // 3))
    body.append("completion: " + _clip_text(str(sample["completion"]), max_chars))
    if "stop" in sample:
        body.append(f"stopped by: {sample['stop']}")
    return head + "\n" + "\n".join(body)


_RECORD_START = '{"step": '  # how every line MetricsWriter writes begins (json.dumps, step first)


def _parse_record(line: str) -> dict:
    if "\ufffd" in line:  # MetricsWriter writes ASCII (json.dumps escapes the rest)
        raise ValueError("not UTF-8 text")
    record = json.loads(line)
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise ValueError("each line must be a JSON object with an integer 'step'")
    return record


def _cut_off(line: str) -> bool:
    """A line a crash cut short: the start of a record (or zero bytes) and no closing brace."""
    text = line.strip().strip("\x00")
    return not text or (text.startswith(_RECORD_START) and not text.endswith("}"))


def read_metrics(run_dir: str | Path) -> list[dict]:
    """All records of ``run_dir/metrics.jsonl`` in file order; nulls come back as NaN.

    What a crash mid-write leaves is skipped with a warning naming the file and line: a cut-off
    last line; a cut-off line that a resumed run then ended (``MetricsWriter`` starts a new line);
    and, in files written before that, a cut-off fragment with the resumed run's first record
    glued on (that record is kept). Any other bad line is an error naming the file and line.
    """
    run_dir = run_paths.as_path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist (expected a directory holding {METRICS_FILE})")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"metrics file {path} does not exist; MetricsWriter.write creates it")
    # "replace": a stray byte becomes U+FFFD and fails on its own line, which the error then names.
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines, start=1) if line.strip()), default=0)
    records = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = _parse_record(line)
        except ValueError as e:
            glued = line.rfind(_RECORD_START)
            if lineno == last:
                log.warning("%s:%d: skipping a cut-off last line (%s)", path, lineno, e)
                continue
            if _cut_off(line):
                log.warning("%s:%d: skipping a line cut off mid-write by a crash: %r", path, lineno, line[:80])
                continue
            if glued > 0 and _cut_off(line[:glued]):
                try:
                    record = _parse_record(line[glued:])
                except ValueError:
                    pass
                else:
                    log.warning("%s:%d: skipping a fragment cut off by a crash, %r, and keeping the record "
                                "glued onto it", path, lineno, line[:glued][:80])
                    records.append({k: (math.nan if v is None else v) for k, v in record.items()})
                    continue
            raise ValueError(f"{path}:{lineno}: not a metrics record ({e}): {line[:200]!r}") from e
        records.append({k: (math.nan if v is None else v) for k, v in record.items()})
    return records


def metric_series(records: Sequence[Mapping[str, Any]], name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of one metric, sorted by step, keeping the last value written for each step.

    A resumed run rewrites the steps after its checkpoint; the last write is the one that counts.
    """
    by_step: dict[int, float] = {}
    for r in records:
        if name in r:
            by_step[int(r["step"])] = float(r[name])
    steps = np.array(sorted(by_step), dtype=np.int64)
    return steps, np.array([by_step[s] for s in steps], dtype=np.float64)
