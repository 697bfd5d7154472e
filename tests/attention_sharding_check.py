"""Run in its own process with 8 fake CPU devices (test_attention.py starts it): the blockwise
kernel inside the model's gradient on meshes of 8 devices equals one device, and runs on each
device's own rows and heads: the program's collectives are exactly those of the same gradient with
the reference kernel (the model's own tensor-parallel reductions), none added by the tiles.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/attention_sharding_check.py OUT.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import compiled_programs  # noqa: E402
from grpo_jax import model as M
from grpo_jax.distributed import sharding

# Two kv heads and four query heads (split over tensor=2), 8 rows (over data * fsdp = 4), a
# sliding second layer, 40 tokens in tiles of 16 (blockwise's smallest real use: three tiles).
CONFIG = M.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, sliding_window=12,
                       layer_types=("full_attention", "sliding_attention"), attention_impl="blockwise")
ROWS, LENGTH, TARGETS = 8, 40, 24


def main() -> int:
    out_path = sys.argv[1]
    graphdef, params = nnx.split(M.init_model(CONFIG, 0), nnx.Param)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, (ROWS, LENGTH)).astype(np.int32)
    mask = np.ones_like(tokens)
    mask[1::2, :5] = 0  # odd rows left-padded
    mask[2, 30:] = 0    # a completion that stopped

    def loss(params, tokens, mask):
        logp = M.token_logprobs(graphdef, params, tokens, mask, num_targets=TARGETS)
        return jnp.sum(logp * mask[:, -TARGETS:])

    grad = jax.grad(loss)
    reference = jax.tree.map(np.asarray, jax.jit(grad)(params, tokens, mask))
    reference_kernel = nnx.graphdef(nnx.eval_shape(
        lambda: M.init_model(dataclasses.replace(CONFIG, attention_impl="xla"), 0)))
    result = {}
    for shape in ((8, 1, 1), (2, 2, 2), (1, 4, 2)):
        mesh = sharding.make_mesh(*shape)
        p_sh, rows = sharding.param_shardings(mesh, params), sharding.batch_sharding(mesh)
        placed = jax.device_put(params, p_sh)
        args = (placed, jax.device_put(tokens, rows), jax.device_put(mask, rows))
        entry = {}
        for name, gd in (("blockwise", graphdef), ("xla", reference_kernel)):
            def grad_of(params, tokens, mask, gd=gd):
                return jax.grad(lambda p: jnp.sum(M.token_logprobs(gd, p, tokens, mask, num_targets=TARGETS)
                                                  * mask[:, -TARGETS:]))(params)

            jitted = sharding.MeshJit(jax.jit(grad_of, in_shardings=(p_sh, rows, rows), out_shardings=p_sh), mesh)
            hlo = jitted.lower(*args).compile().as_text()
            entry[f"{name}_collectives"] = sorted((c.op, c.shape) for c in compiled_programs.collectives(hlo))
            if name == "blockwise":
                got = jax.tree.map(np.asarray, jitted(*args))
                entry["max_rel_diff"] = max(float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))
                                            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference)))
        result[",".join(map(str, shape))] = entry
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
