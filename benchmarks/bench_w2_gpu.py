"""W2 on one accelerator: a random Qwen2-0.5B-shaped policy in bfloat16, 16 prompts x G=8, 512 new
tokens (ignore_eos), through `train.run`. Reports the update's MFU against the chip's bf16 peak and
decode tokens/s against the HBM-bandwidth roofline. Writes a JSON file.

    .venv/bin/python benchmarks/bench_w2_gpu.py [--out benchmarks/results/w2.json]
    .venv/bin/python benchmarks/bench_w2_gpu.py --smoke      # CPU check of this script (tiny shapes)

Peaks come from the table below by device kind (dense bf16 FLOP/s, HBM bytes/s; vendor figures),
or --peak-tflops / --hbm-gbps. Roofline for decode: each step reads every weight once plus each
row's KV cache, so tokens/s <= B / ((weight bytes + KV bytes) / HBM bandwidth).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import tempfile

import jax

from grpo_jax.cli import bench
from grpo_jax.training import train
from grpo_jax.model import ModelConfig
from grpo_jax.io.tokenizer import load_tokenizer

# device_kind substring -> (dense bf16 FLOP/s, HBM bytes/s)
PEAKS = {
    "H200": (989e12, 4.8e12),
    "H100": (989e12, 3.35e12),
    "A100": (312e12, 2.0e12),
    "L4": (121e12, 0.3e12),
    "TPU v5 lite": (197e12, 0.82e12),
    "TPU v5p": (459e12, 2.76e12),
    "TPU v4": (275e12, 1.2e12),
    "TPU v6": (918e12, 1.64e12),
}

# float32 masters (config validation refuses bf16 ones), bf16 compute.
QWEN2_05B = bench.W2_MODEL
SMOKE = dataclasses.replace(bench.W1_MODEL, dtype="bfloat16")


def chip_peaks(kind: str) -> tuple[float, float] | None:
    for name, peaks in PEAKS.items():
        if name.lower() in kind.lower():
            return peaks
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/w2.json")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any backend: checks the script")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="bf16 dense peak; 0: from the table")
    parser.add_argument("--hbm-gbps", type=float, default=0.0, help="HBM bandwidth; 0: from the table")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="W2's 512; longer for reasoning lengths")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error(f"--steps must be >= 3 (median over steps 3..N), got {args.steps}")
    dev = jax.devices()[0]
    if not args.smoke and dev.platform == "cpu":
        sys.exit("bench_w2_gpu.py: no accelerator found (jax.devices() is CPU); run on a GPU/TPU "
                 "machine, or pass --smoke for a tiny CPU check of the script")
    model = SMOKE if args.smoke else QWEN2_05B
    n, g, c = (2, 4, 16) if args.smoke else (16, 8, args.max_new_tokens)
    run_dir = tempfile.mkdtemp(prefix="grpo_w2_")
    config = bench.w1_config(run_dir, steps=args.steps, prompts_per_step=n, num_generations=g,
                             max_new_tokens=c, model=model)
    config = dataclasses.replace(config, grpo=dataclasses.replace(config.grpo, ref_dtype="bfloat16"))
    tokenizer = bench.WideVocabTokenizer(load_tokenizer(model.tokenizer_spec()))
    result = train.run(config, task=bench.AdditionTask(), tokenizer=tokenizer)
    summary = bench.summarize_steps(result.history, first=3, last=args.steps)

    mc = ModelConfig(vocab_size=model.vocab_size, hidden_size=model.hidden_size,
                     intermediate_size=model.intermediate_size, num_layers=model.num_layers,
                     num_heads=model.num_heads, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                     qkv_bias=model.qkv_bias, tie_embeddings=model.tie_embeddings)
    p = bench.W1_PROMPT_LEN
    # Counted as run: each prompt once per group where the trainer does that (the update's MFU).
    flops = bench.executed_step_flops(config, mc, prompt_len=p, num_devices=len(jax.devices()))
    b = n * g
    layers, head = bench.matmul_params(mc)
    weight_bytes = 2 * (layers + head + (0 if mc.tie_embeddings else mc.vocab_size * mc.hidden_size))
    # Mean KV bytes read per decode step: every slot of the cache (the kernels read masked slots too).
    kv_bytes = 2 * 2 * mc.num_layers * b * mc.num_kv_heads * mc.head_dim * (p + c)
    rollout_s, update_s = summary["time/rollout"], summary["time/update"]
    out = {
        "workload": f"W2 {n}x{g}x{c}" + (" (smoke)" if args.smoke else ""),
        "device": dev.device_kind, "platform": dev.platform,
        "step_s_median": summary["time/step"],
        "split_s_median": {k.split("/", 1)[1]: v for k, v in summary.items()
                           if k.startswith("time/") and k != "time/step"},
        "decode_tokens_per_s": b * c / rollout_s,
        "flops_per_step": dataclasses.asdict(flops) | {"total": flops.total},
        "update_flops_per_s": flops.policy / update_s,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        # What the device really peaked at (XLA's allocator), for `check`'s figures to be held against.
        "device_peak_bytes": (dev.memory_stats() or {}).get("peak_bytes_in_use"),
    }
    peaks = chip_peaks(dev.device_kind)
    peak_flops = args.peak_tflops * 1e12 or (peaks[0] if peaks else 0.0)
    hbm = args.hbm_gbps * 1e9 or (peaks[1] if peaks else 0.0)
    if peak_flops:
        out["update_mfu"] = out["update_flops_per_s"] / peak_flops
        out["step_mfu"] = flops.total / summary["time/step"] / peak_flops
    if hbm:
        roofline = b / ((weight_bytes + kv_bytes) / hbm)
        out["decode_roofline_tokens_per_s"] = roofline
        out["decode_fraction_of_roofline"] = out["decode_tokens_per_s"] / roofline
    print(json.dumps(out, indent=2))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
