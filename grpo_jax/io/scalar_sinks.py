"""Where a run's scalars go besides metrics.jsonl: TensorBoard and Weights & Biases (TRL's
`report_to` names), both optional installs, with the same metric names as metrics.jsonl.

TensorBoard: tensorboardX's `add_scalar` rewrites names outside [A-Za-z0-9_./-] (`eval/pass@1`
became `eval/pass_1`, with an "illegal name" log line each time); TensorBoard itself shows any tag,
so the summary is written with the name unchanged. W&B: `wandb.init` in `run_dir/wandb`, one run
per run directory (its id derived from the directory, so a resumed run continues the same W&B run);
`WANDB_MODE=offline` works without a network, as W&B documents.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Mapping, Protocol, Sequence

log = logging.getLogger(__name__)

REPORT_TO = ("tensorboard", "wandb")


class ScalarSink(Protocol):
    def write(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars into `log_dir` as TensorBoard event files (tensorboardX), names unchanged."""

    def __init__(self, log_dir: Path):
        from tensorboardX import SummaryWriter  # type: ignore[import-not-found]
        from tensorboardX.proto.summary_pb2 import Summary  # type: ignore[import-not-found]

        self._writer = SummaryWriter(str(log_dir))
        self._summary = Summary

    def write(self, step: int, values: Mapping[str, float]) -> None:
        summary = self._summary(value=[self._summary.Value(tag=name, simple_value=float(v)) for name, v in values.items()])
        self._writer._get_file_writer().add_summary(summary, int(step))

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


class WandbSink:
    """Scalars to Weights & Biases under their metrics.jsonl names."""

    def __init__(self, run_dir: str, local_dir: Path, project: str, config: dict | None):
        import wandb  # type: ignore[import-not-found]

        (local_dir / "wandb").mkdir(parents=True, exist_ok=True)
        run_id = hashlib.sha1(run_dir.encode()).hexdigest()[:16]
        name = run_dir.rstrip("/").rsplit("/", 1)[-1]
        self.run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=str(local_dir), config=config)

    def write(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=int(step))

    def close(self) -> None:
        self.run.finish()


def open_sinks(report_to: Sequence[str], run_dir, *, wandb_project: str = "grpo_jax",
               config: dict | None = None) -> list[ScalarSink]:
    """The sinks `report_to` names that are installed; a missing package is one log line, not an
    error (metrics.jsonl always has everything). A run_dir on object storage (`gs://...`) keeps
    TensorBoard off (its event files are local) and gives W&B a local temp dir for its files."""
    import os
    import tempfile

    run_dir_text = os.fspath(run_dir)
    local = "://" not in run_dir_text
    local_dir = Path(run_dir_text) if local else Path(tempfile.mkdtemp(prefix="grpo_jax_wandb_"))
    sinks: list[ScalarSink] = []
    for name in report_to:
        if name not in REPORT_TO:
            raise ValueError(f"report_to: unknown sink {name!r}; choose from {list(REPORT_TO)}")
        try:
            if name == "tensorboard":
                if not local:
                    log.info("TensorBoard off for a run_dir on object storage (%s): use wandb, or metrics.jsonl",
                             run_dir_text)
                    continue
                sinks.append(TensorBoardSink(local_dir / "tensorboard"))
            else:
                sinks.append(WandbSink(run_dir_text, local_dir, wandb_project, config))
        except ImportError:
            extra = "tensorboard" if name == "tensorboard" else "wandb"
            log.info("%s off: install it (pip install 'grpo_jax[%s]') to enable it", name, extra)
    return sinks
