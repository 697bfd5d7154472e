"""`check` at reasoning lengths (issue 22): the shipped 0.5B and 7B configs at 2k, 8k and 32k new
tokens, for several rows per micro-batch, against H100 / H200 / v5p / v6e memory. Prints a
Markdown table and writes benchmarks/results/check_lengths.json.

    .venv/bin/python benchmarks/check_lengths.py [--lengths 2048 8192 32768] [--quick]

Each point is `python -m grpo_jax check --json` in its own process (fake CPU devices where the
mesh needs more): update-phase peak, the rollout-phase peak and the whole step's peak per device,
from programs compiled by this machine's CPU backend (estimates of an accelerator's; remat is
honoured on the CPU too, `grpo_jax.model.remat`). --quick: rows per micro-batch 1 only.

0.5B: configs/qwen25_05b_gpu.py on 1 device (model.remat=true), 2 prompts x G=8 = 16 rows per
step, grad_accum_steps = 16 / rows per micro-batch. 7B: configs/tpu_pod.py on 16 chips (fsdp=4 x
tensor=4, model.remat=true), 16 prompts x 16 = 256 rows, num_minibatches=1; rows per chip = rows
per micro-batch / 4.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Memory per chip in GiB (the vendors' HBM figures; a GPU's XLA pool is 75% of it by default,
# XLA_PYTHON_CLIENT_MEM_FRACTION raises it).
CHIPS = {"H100 80GB": 80e9 / 2**30, "H200 141GB": 141e9 / 2**30, "v5p 95GB": 95e9 / 2**30, "v6e 32GB": 32e9 / 2**30}


def run_check(config: str, shape: str, devices: int, sets: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "check.json")
        cmd = [sys.executable, "-m", "grpo_jax", "check", "--config", config, "--model-shape", shape,
               "--devices", str(devices), "--json", out] + [a for s in sets for a in ("--set", s)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        if proc.returncode not in (0, 3):
            return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}
        return json.load(open(out))


def points(lengths, quick: bool):
    for length in lengths:
        for rows in ((1,) if quick else (1, 2, 4, 8)):
            yield ("0.5B", "configs/qwen25_05b_gpu.py", "qwen2.5-0.5b", 1, length, rows,
                   ["model.remat=true", "grpo.prompts_per_step=2", "grpo.num_generations=8", "grpo.num_minibatches=1",
                    f"grpo.grad_accum_steps={16 // rows}", f"sampling.max_new_tokens={length}"])
        for per_chip in ((1,) if quick else (1, 2, 4)):
            yield ("7B", "configs/tpu_pod.py", "qwen2.5-7b", 16, length, per_chip,
                   ["model.remat=true", "grpo.prompts_per_step=16", "grpo.num_generations=16",
                    "grpo.num_minibatches=1", f"grpo.grad_accum_steps={256 // (4 * per_chip)}",
                    f"sampling.max_new_tokens={length}"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[2048, 8192, 32768])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    results = []
    gib = 2**30
    print("| model | new tokens | rows per micro-batch per device | update phase | rollout phase | "
          + " | ".join(f"fits {c}" for c in CHIPS) + " |")
    print("|---|---|---|---|---|" + "---|" * len(CHIPS))
    for name, config, shape, devices, length, rows, sets in points(args.lengths, args.quick):
        f = run_check(config, shape, devices, sets)
        results.append({"model": name, "new_tokens": length, "rows_per_device": rows, "sets": sets, "check": f})
        if "error" in f:
            print(f"| {name} | {length} | {rows} | error: {f['error']} |")
            continue
        phases = f["phases"]
        update = max(v for k, v in phases.items() if k.startswith("update")) / gib
        rollout = phases.get("rollout", 0) / gib
        peak = f["peak"]["bytes"] / gib
        fits = " | ".join("yes" if peak <= cap else "no" for cap in CHIPS.values())
        print(f"| {name} | {length:,} | {rows} | {update:.1f} GiB | {rollout:.1f} GiB | {fits} |", flush=True)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", "check_lengths.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
