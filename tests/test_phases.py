"""Phases of `grpo_jax.training.phases` not covered by the loop tests: the reference resync."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np

from grpo_jax.training import phases
from grpo_jax.training.run_context import RunState


def test_the_reference_becomes_the_policy_every_n_steps_only():
    # grpo.ref_resync_every = 2: after step 2 the reference is a frozen copy of the policy (in the
    # reference's dtype, bf16 here); after step 3 it is left as it was.
    ctx = types.SimpleNamespace(config=types.SimpleNamespace(grpo=types.SimpleNamespace(ref_resync_every=2)),
                                uses_reference=True, ref_dtype=jnp.bfloat16)
    state = RunState(step=1, data_position=0, params={"w": jnp.full((2,), 1.5)}, opt_state=None,
                     ref_params={"w": jnp.zeros((2,), jnp.bfloat16)})
    synced = phases.sync_reference(ctx, state, 2)
    assert synced.ref_params["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(synced.ref_params["w"], np.float32), [1.5, 1.5])  # 1.5 exact in bf16
    assert phases.sync_reference(ctx, state, 3) is state
    # beta = 0 keeps no reference: nothing to resync whatever the step.
    no_ref = types.SimpleNamespace(**{**vars(ctx), "uses_reference": False})
    assert phases.sync_reference(no_ref, state, 2) is state
