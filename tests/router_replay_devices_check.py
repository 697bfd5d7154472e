"""Routing replay on several (fake CPU) devices, in its own process (tests/test_router_replay.py runs it).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/router_replay_devices_check.py OUT RUN_DIR HF_PATH

Trains one step of test_router_replay's skewed-sampler run with off_policy.router_replay="R3" on every
device (mesh data = device count) and writes JSON to OUT: the device count, the step's metrics, and the
rows of the step's experts array [B, P+C, L, K] each device holds ([start, stop) per device, in order).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import jax  # noqa: E402

from grpo_jax.training import phases  # noqa: E402
from test_router_replay import run_skewed  # noqa: E402


def main(out: str, run_dir: str, hf_path: str) -> None:
    seen = []
    device_rows = phases.device_rows

    def recording_device_rows(*args, **kwargs):
        rows = device_rows(*args, **kwargs)
        shards = sorted(rows["experts"].addressable_shards, key=lambda s: s.device.id)
        seen.append([[s.index[0].start or 0, s.index[0].stop or rows["experts"].shape[0]] for s in shards])
        return rows

    phases.device_rows = recording_device_rows
    history = run_skewed(run_dir, hf_path, "R3", types.SimpleNamespace(setattr=setattr), steps=1)
    Path(out).write_text(json.dumps({"device_count": jax.device_count(), "history": history,
                                     "experts_sharding": seen[0]}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
