"""grpo_jax.model.grouped_matmul: the tiled form equals jax.lax.ragged_dot, values and gradients,
on group layouts that exercise its edges (empty groups, groups inside one tile, across tiles, a
tile larger than all rows)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.model.grouped_matmul import grouped_matmul, resolve


@pytest.mark.parametrize("sizes, tile", [
    ([3, 0, 4, 3], 4),        # an empty group; a group boundary inside tiles 0 and 1
    ([0, 10, 0], 4),          # one group across three tiles, the last one partial
    ([1, 1, 1, 1, 1, 1], 4),  # six groups in two tiles: the most pairs (tiles + groups)
    ([2, 3], 128),            # a tile larger than all 5 rows
    ([0, 0, 7], 7),           # empty groups first; rows exactly one tile
    ([5, 0, 2, 9], None),     # the default tile, the mean group size rounded up to 8
])
def test_tiled_equals_ragged_dot_values_and_gradients(sizes, tile):
    rng = np.random.default_rng(len(sizes) * 100 + (tile or 0))
    m, d, f = sum(sizes), 5, 3
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((len(sizes), d, f)), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    cot = jnp.asarray(rng.standard_normal((m, f)), jnp.float32)

    def run(impl):
        out, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, sizes, impl, tile=tile), x, w)
        return out, vjp(cot)

    (ref, ref_grads), (got, got_grads) = run("ragged"), run("tiled")
    # Each output is one length-5 dot product, the same terms: float32 rounding only (|x w| ~ 3,
    # 5 * u * 3 ~ 1e-6). Weight gradients sum over a group's rows in another order (<= 10 rows).
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(got_grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_auto_is_ragged_on_tpu_only():
    assert resolve("auto", "tpu") == "ragged"
    assert resolve("auto", "gpu") == resolve("auto", "cpu") == "tiled"
    with pytest.raises(ValueError, match="must be one of \\['auto', 'ragged', 'tiled'\\]"):
        resolve("dense")
