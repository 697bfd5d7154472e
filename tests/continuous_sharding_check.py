"""The continuous engine on device meshes against one device (run by tests/test_continuous.py with
8 fake CPU devices): python tests/continuous_sharding_check.py OUT.json

16 prompts x G=2 = 32 rows through 16 slots on meshes (8,1,1), (2,2,2), (1,8,1); the JSON records
whether tokens and masks equal the one-device sampler's, the largest log-prob difference, and from
the compiled decode program each device's rows of the slot caches and of the row outputs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))

import compiled_programs  # noqa: E402
from grpo_jax import model as model_lib
from grpo_jax.distributed import sharding
from grpo_jax.sampling.sampler import Sampler, SamplingConfig  # noqa: E402

CONFIG = model_lib.ModelConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                               num_kv_heads=2, head_dim=16)
MESHES = ("8,1,1", "2,2,2", "1,8,1")
SLOTS, GROUP = 16, 2


def main(out_path: str) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 47, rng.integers(2, 9)).tolist() for _ in range(16)]
    sampling = SamplingConfig(max_new_tokens=20, temperature=1.0)
    graphdef, params = nnx.split(model_lib.init_model(CONFIG, 3))
    one = Sampler(graphdef, CONFIG, eos_id=(0, 1), pad_id=47, engine="continuous", decode_slots=SLOTS)
    ref = jax.tree.map(np.asarray, one(params, prompts, num_samples=GROUP, sampling=sampling, rng=jax.random.key(5)))
    result = {"rows": 32, "slots": SLOTS, "meshes": {}}
    for mesh_text in MESHES:
        mesh = sharding.make_mesh(*(int(v) for v in mesh_text.split(",")))
        g2, p2 = sharding.init_params_sharded(mesh, CONFIG, seed=3)
        sampler = Sampler(g2, CONFIG, eos_id=(0, 1), pad_id=47, engine="continuous", decode_slots=SLOTS, mesh=mesh)
        out = jax.tree.map(np.asarray, sampler(p2, prompts, num_samples=GROUP, sampling=sampling, rng=jax.random.key(5)))
        _, decode = sampler.lower(p2, prompts, num_samples=GROUP, sampling=sampling, rng=jax.random.key(5))
        shapes = compiled_programs.per_device_parameter_shapes(decode.compile())
        cache = [v for k, v in shapes.items() if "caches" in k and "[0]" in k]
        outputs = [v for k, v in shapes.items() if "tokens_QxC" in k]
        result["meshes"][mesh_text] = {
            "tokens_equal": bool(np.array_equal(out.tokens_BxC, ref.tokens_BxC)),
            "mask_equal": bool(np.array_equal(out.mask_BxC, ref.mask_BxC)),
            "logp_max_diff": float(np.abs(out.logprobs_BxC - ref.logprobs_BxC).max()),
            "slot_cache_rows": int(cache[0][0]),
            "output_rows": int(outputs[0][0]),
            "shapes": {k: list(v) for k, v in shapes.items()},
        }
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
