"""The sampler on device meshes against one device, and what each device's compiled programs do.

Run by tests/test_sampler_sharding.py in its own process with 8 fake CPU devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sampler_sharding_check.py OUT.json \
        --meshes 8,1,1 2,2,2 --uneven 8,1,1 --control 2,2,2

For each mesh and workload the sampler (params in the training layout, as the trainer passes them)
samples with a fixed key; the JSON records how its outputs compare with the one-device sampler's
and, from `Sampler.lower(...).compile()`, each device's argument shapes and the collectives inside
the decode loop. `--control MESH` also compiles the old layout on that mesh (no Sampler mesh: host
prompts replicated to every device, weights in the training layout), which the assertions must catch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))

import compiled_programs  # noqa: E402
from grpo_jax import model as model_lib
from grpo_jax.distributed import sharding
from grpo_jax.model import blockwise  # noqa: E402
from grpo_jax.sampling.sampler import Sampler, SamplingConfig  # noqa: E402

# Weights much larger than one decode step's activations, so "weight-sized" and "activation-sized"
# collectives are told apart by bytes on the fsdp meshes: the smallest matrix a device holds in the
# decode layout is k_proj [D=128, K=2 (1 per device on tensor=2), H=16] = 8 KiB on (2,2,2), while a
# row's largest activation is F=256 floats = 1 KiB, and those meshes hold <= 4 rows per device
# ((1,1,8) holds all 16 rows: its activation all-reduces are as large as an [8, 128] embedding
# shard, so only the device-group test applies there). N=8 heads split over tensor up to 8; K=2 kv heads do not
# divide by 8, so (1,1,8) takes the replication fallback for k/v and the cache. One layer keeps
# compiles short (tests/test_sampler.py chains the caches of two).
MODEL = model_lib.ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=1,
                              num_heads=8, num_kv_heads=2, head_dim=16)
# EOS 7 is sampled by some rows of both workloads below and not by others, so the masks and the
# truncation flags have both values.
EOS, PAD = 7, 0
SEED = 11
PROMPTS = [[5, 9, 12], [7, 3, 22, 30, 4], [11, 2], [40, 41, 17, 8], [3], [60, 61, 62], [13, 14], [50, 9, 9]]
# name -> (prompts, G, decode block). "8x2": 16 rows, prompts divide data*fsdp = 8 or 4 (each
# device prefills 8 / (data*fsdp) prompts); its cache is one decode block. "4x4": 16 rows, 4
# prompts over 8 row devices (each prefills one prompt, shared by two devices); its decode attends
# block by block (blocks of 4 slots, up to the rows' position: blockwise.decode_attention).
WORKLOADS = {"8x2": (PROMPTS, 2, 256), "4x4": (PROMPTS[:4], 4, 4)}
SAMPLING = SamplingConfig(max_new_tokens=6, temperature=1.0)
ROW_FIELDS = ("prompt_tokens_BxP", "prompt_mask_BxP", "tokens_BxC", "mask_BxC", "truncated_B", "logprobs_BxC")


def logprob_tolerance(params, prompt_len: int) -> float:
    """Bound on |log-prob on a mesh - log-prob on one device| for equal tokens, in float32.

    Both runs do the same arithmetic in another order (a contraction split over tensor devices and
    summed by an all-reduce, matmuls blocked for 2 rows instead of 16). A float32 dot product of
    length n summed in any order is within gamma_n * sum|x_i y_i| of the exact value,
    gamma_n = n u / (1 - n u), u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms,
    Thm 3.1), so two orders are within 2 gamma_n of each other, relative to sum|x_i y_i|.
      * Hidden state h (first order; RMSNorm rescales every layer, and residual adds, softmax and
        SiLU are taken as gain <= 1 at these magnitudes): each layer runs the contractions
        q/k/v (n = D), scores (H), values (S = P + C), o_proj (N*H), gate/up (D), down (F), so
        ||dh|| / ||h|| <= eps_h = L * sum_i 2 gamma_{n_i} + L * 16 u (norms, RoPE, residual adds).
      * Logits z_v = h . w_v (w_v a column of lm_head): |dz_v| <= (eps_h + 2 gamma_D) ||h|| ||w_v||,
        with ||h|| <= sqrt(D) * max|final_norm| (an RMS-normalised vector).
      * log p = z_tok / T - logsumexp(z / T): each term moves by at most max|dz| / T, plus the
        softmax's own sum over V terms (2 gamma_V relative to logsumexp, <= max|z| / T + log V).
    """
    u = 2.0 ** -24

    def gamma(n):
        return n * u / (1 - n * u)

    c = MODEL
    s = prompt_len + SAMPLING.max_new_tokens
    eps_h = c.num_layers * (2 * sum(gamma(n) for n in (c.hidden_size, c.head_dim, s, c.num_heads * c.head_dim,
                                                       c.hidden_size, c.intermediate_size)) + 16 * u)
    w = np.asarray(_value(params["lm_head"]), np.float64)  # [D, V]
    h_norm = math.sqrt(c.hidden_size) * float(np.max(np.abs(np.asarray(_value(params["final_norm"])))))
    dz = (eps_h + 2 * gamma(c.hidden_size)) * h_norm * float(np.max(np.linalg.norm(w, axis=0)))
    z_max = h_norm * float(np.max(np.linalg.norm(w, axis=0)))
    t = SAMPLING.temperature
    return 2 * dz / t + 2 * gamma(c.vocab_size) * (z_max / t + math.log(c.vocab_size))


def _value(node):
    return node.get_value() if hasattr(node, "get_value") else node.value


def host(out) -> dict[str, np.ndarray]:
    return {name: np.asarray(getattr(out, name)) for name in ROW_FIELDS}


def tensor_peers_only(groups, mesh) -> bool:
    """True iff every group's devices hold the same rows (differ only in their tensor index).

    Partition p is mesh.devices.flat[p]; its (data, fsdp, tensor) coordinates unravel from p."""
    shape = mesh.devices.shape
    return all(len({np.unravel_index(p, shape)[:2] for p in group}) == 1 for group in groups)


def inspect_programs(sampler, params, prompts, g, mesh) -> dict:
    """Per-device argument shapes and collectives of the compiled prefill and decode programs."""
    prefill_lowered, decode_lowered = sampler.lower(params, prompts, num_samples=g, sampling=SAMPLING,
                                                    rng=jax.random.key(SEED))
    prefill, decode = prefill_lowered.compile(), decode_lowered.compile()
    pre_shapes = compiled_programs.per_device_parameter_shapes(prefill)
    dec_shapes = compiled_programs.per_device_parameter_shapes(decode)
    # jit's input shardings of the prompt rows (arguments 1 and 2 of prefill).
    token_specs = [str(s.spec) for s in jax.tree.leaves(prefill.input_shardings[0][1:])]
    loop = compiled_programs.collectives_in_while_bodies(decode.as_text())
    return {
        "prefill_tokens": pre_shapes["tokens_MxP"],
        "prefill_mask": pre_shapes["mask_MxP"],
        "prefill_token_specs": token_specs,
        # Every row-carrying piece of the decode state, as each device's program takes it.
        "decode_rows": {path: shape[0] for path, shape in dec_shapes.items()
                        if path.startswith("state.") and path != "state.step"},
        "decode_cache": dec_shapes["state.caches[0].k_BxKxHxS"],
        "decode_weights": {path: shape for path, shape in dec_shapes.items() if path.startswith("params")},
        "loop_collectives": [{"op": c.op, "shape": c.shape, "bytes": c.bytes,
                              "tensor_peers_only": tensor_peers_only(c.groups, mesh)} for c in loop],
        "prefill_collective_max_bytes": max([c.bytes for c in compiled_programs.collectives(prefill.as_text())],
                                            default=0),
    }


def smallest_weight_bytes(weight_shapes: dict) -> int:
    """Bytes of the smallest weight matrix (ndim >= 2) one device holds, float32."""
    return min(4 * math.prod(shape) for shape in weight_shapes.values() if len(shape) >= 2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--meshes", nargs="*", default=[])
    parser.add_argument("--uneven", nargs="*", default=[], help="meshes on which to run the 4x4 workload too")
    parser.add_argument("--control", default="", help="mesh on which to compile the old layout too")
    parser.add_argument("--cache-dir", default="", help="XLA compilation cache: the programs that "
                        "Sampler.lower compiles again for inspection are then read back, not rebuilt")
    args = parser.parse_args(argv)
    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    t0 = time.perf_counter()
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_lib.init_model(MODEL, 0)))
    params1 = jax.jit(lambda: nnx.split(model_lib.init_model(MODEL, 0))[1])()
    result: dict = {"device_count": jax.device_count(), "reference": {}, "meshes": {}}
    reference = {}
    for name, (prompts, g, block) in WORKLOADS.items():
        blockwise.DECODE_BLOCK = block  # read when the sampler traces its decode (its first call)
        one = Sampler(graphdef, MODEL, eos_id=EOS, pad_id=PAD)
        reference[name] = host(one(params1, prompts, num_samples=g, sampling=SAMPLING, rng=jax.random.key(SEED)))
        result["reference"][name] = {
            "rows": int(reference[name]["tokens_BxC"].shape[0]),
            "truncated": int(reference[name]["truncated_B"].sum()),
            "logprob_tolerance": logprob_tolerance(params1, reference[name]["prompt_tokens_BxP"].shape[1]),
        }

    for text in args.meshes:
        t1 = time.perf_counter()
        mesh = sharding.make_mesh(*(int(v) for v in text.split(",")))
        # The same values in the training layout (what the trainer passes); device_put, not
        # sharding.init_params_sharded, which would compile an init per mesh.
        params = jax.device_put(params1, sharding.param_shardings(mesh, params1))
        g2 = graphdef
        entry = {}
        for name, (prompts, g, block) in WORKLOADS.items():
            if name == "4x4" and text not in args.uneven:
                continue
            blockwise.DECODE_BLOCK = block
            sampler = Sampler(g2, MODEL, eos_id=EOS, pad_id=PAD, mesh=mesh)
            out = sampler(params, prompts, num_samples=g, sampling=SAMPLING, rng=jax.random.key(SEED))
            got, want = host(out), reference[name]
            rows = sharding.batch_sharding(mesh)
            programs = inspect_programs(sampler, params, prompts, g, mesh)
            entry[name] = {
                "equal": {f: bool(np.array_equal(got[f], want[f])) for f in ROW_FIELDS if f != "logprobs_BxC"},
                "logprob_max_diff": float(np.max(np.abs(got["logprobs_BxC"] - want["logprobs_BxC"]))),
                "rows_sharded": {f: bool(getattr(out, f).sharding.is_equivalent_to(rows, getattr(out, f).ndim))
                                 for f in ROW_FIELDS},
                "process_rows_ok": all(np.array_equal(sharding.process_rows(getattr(out, f)), got[f])
                                       for f in ROW_FIELDS),
                "smallest_weight_bytes": smallest_weight_bytes(programs["decode_weights"]),
                **programs,
            }
        # Rows that split over neither the prompts nor the rows: 3 prompts x 2 = 6 rows.
        try:
            Sampler(g2, MODEL, eos_id=EOS, pad_id=PAD, mesh=mesh)(
                params, PROMPTS[:3], num_samples=2, sampling=SAMPLING, rng=jax.random.key(SEED))
            entry["indivisible_error"] = None
        except ValueError as e:
            entry["indivisible_error"] = str(e)
        if text == args.control:
            # The old layout: no mesh on the Sampler, host prompts go to jit unsharded (replicated),
            # the weights stay in the training layout (fsdp-sharded).
            blockwise.DECODE_BLOCK = WORKLOADS["8x2"][2]
            old = Sampler(g2, MODEL, eos_id=EOS, pad_id=PAD)
            entry["control"] = inspect_programs(old, params, WORKLOADS["8x2"][0], WORKLOADS["8x2"][1], mesh)
        entry["seconds"] = time.perf_counter() - t1
        result["meshes"][text] = entry
        print(f"mesh {text}: {entry['seconds']:.1f}s", file=sys.stderr, flush=True)
    result["seconds"] = time.perf_counter() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
