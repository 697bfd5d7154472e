"""The shipped pod config runs as users launch it: two processes joined by jax.distributed (here
two localhost CPU processes, each with one device), DAPO dynamic sampling on, a run directory given
as a URL (file://, the same epath route as gs://), the model and data at local paths.

Only the placeholders (model and data paths, run_dir) and the sizes a 2-core CPU cannot afford
(new tokens, evaluation size, steps, verifier workers) are overridden, and mesh.tensor=1 (the config's
tensor=4 needs 4 devices; fsdp=-1 then takes the 2 there are); everything else is configs/tpu_pod.py
as shipped.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hf_fixtures import make_tiny_instruct_checkpoint

from grpo_jax.tasks import named_eval_set

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_pod_config_runs_three_steps_on_two_processes_with_dynamic_sampling(tmp_path):
    ckpt = make_tiny_instruct_checkpoint(tmp_path / "Qwen-tiny-Instruct")
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(open(named_eval_set("gsm8k")).readlines()[:160]))
    run = tmp_path / "run"
    overrides = [f"model.hf_path={ckpt}", f"task.options.path={data}", f"train.run_dir=file://{run}",
                 "train.steps=3", "sampling.max_new_tokens=8", "eval.num_questions=8", "eval.num_samples=2",
                 "eval.ks=[1,2]", "rewards.workers=1", "train.report_to=[]", "mesh.tensor=1"]
    port = _free_port()
    procs = []
    for i in range(2):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "GRPO_COORDINATOR": f"localhost:{port}",
               "GRPO_NUM_PROCESSES": "2", "GRPO_PROCESS_ID": str(i),
               "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
        cmd = [sys.executable, "-m", "grpo_jax", "train", "--config", "configs/tpu_pod.py", "--allow-cpu"]
        for o in overrides:
            cmd += ["--set", o]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        logs = [p.communicate(timeout=1200)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # eval at step 0, then the 3 steps
    assert all(1 <= r["dynamic_sampling/rounds"] <= 5 for r in rows[1:])
    assert (run / "checkpoints" / "3").is_dir() and (run / "hf" / "model.safetensors").is_file()
    assert not (ROOT / "file:").exists()  # the URL was not taken for a relative local path
