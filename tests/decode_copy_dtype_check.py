"""A bfloat16 model's sampler on a (1, 4, 1) mesh: its decode copy (whole along fsdp) is bfloat16,
half float32's bytes, and it samples the same tokens and log-probs, bit for bit, as a float32 copy.

Run by tests/test_sampler_sharding.py with 4 fake CPU devices: python tests/decode_copy_dtype_check.py OUT.json
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
from flax import nnx

from grpo_jax import model as model_lib
from grpo_jax.distributed import sharding
from grpo_jax.sampling.sampler import Sampler, SamplingConfig

CONFIG = model_lib.ModelConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                               num_kv_heads=2, head_dim=16, dtype="bfloat16", param_dtype="float32")


def main(out_path: str) -> None:
    mesh = sharding.make_mesh(data=1, fsdp=4, tensor=1)
    graphdef, params = sharding.init_params_sharded(mesh, CONFIG, seed=3)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0)
    outputs, copies = {}, {}
    original = sharding.decode_params
    for name, dtype in (("bfloat16 copy", None), ("float32 copy", "float32")):
        def decode_params(mesh, params, dtype=None, _forced=dtype):
            copy = original(mesh, params, dtype=dtype if _forced is None else np.float32)
            copies[name] = sorted({str(x.dtype) for x in jax.tree.leaves(copy)})
            copies[name + " bytes"] = max(sharding.bytes_per_device(copy).values())
            return copy

        sharding.decode_params = decode_params
        sampler = Sampler(graphdef, CONFIG, eos_id=0, pad_id=47, mesh=mesh)
        out = sampler(params, prompts, num_samples=2, sampling=sampling, rng=jax.random.key(5))
        outputs[name] = (np.asarray(out.tokens_BxC), np.asarray(out.logprobs_BxC))
    sharding.decode_params = original
    a, b = outputs["bfloat16 copy"], outputs["float32 copy"]
    json.dump({"copies": copies, "tokens_equal": bool(np.array_equal(a[0], b[0])),
               "logprobs_equal": bool(np.array_equal(a[1], b[1])),
               "distinct_tokens": int(len(np.unique(a[0])))}, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1])
