"""AdamW's weight decay reaches weight matrices only (as Hugging Face's Trainer: not norm scales or
biases; and not the token embeddings); the schedule warms up, then holds or decays."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax import model as model_lib
from grpo_jax.training import optim
from grpo_jax.config import OptimSection

MODEL = model_lib.ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                              num_kv_heads=1, head_dim=4, qkv_bias=True, qk_norm=True)


def test_every_weight_of_the_model_table_is_decayed_or_not_on_purpose():
    assert set(model_lib.SHARDING) == optim.DECAYED_WEIGHTS | optim.UNDECAYED_WEIGHTS
    assert not optim.DECAYED_WEIGHTS & optim.UNDECAYED_WEIGHTS


def test_weight_decay_shrinks_matrices_and_leaves_norms_biases_and_embeddings():
    # Zero gradient, so Adam's own step is 0 and only decoupled decay moves weights:
    # w <- w - lr * wd * w = w * (1 - 0.1 * 0.5) for matrices, unchanged elsewhere.
    _, params = nnx.split(model_lib.init_model(MODEL, 0))
    params = jax.tree.map(lambda x: x + 1.0, params)  # biases start at 0: make every change visible
    tx, _ = optim.make_optimizer(OptimSection(learning_rate=0.1, weight_decay=0.5, max_grad_norm=0.0), 10)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    decayed = []
    for path, before, step in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(params),
                                  jax.tree.leaves(updates)):
        name = [getattr(k, "key", None) for k in path[0]][-2]
        after = np.asarray(before + step)
        if name in optim.DECAYED_WEIGHTS:
            np.testing.assert_allclose(after, np.asarray(before) * 0.95, rtol=1e-6)
            decayed.append(name)
        else:
            np.testing.assert_array_equal(after, np.asarray(before), err_msg=name)
    assert sorted(decayed) == ["down_proj", "gate_proj", "k_proj", "lm_head", "o_proj", "q_proj", "up_proj",
                               "v_proj"]


def test_unknown_weight_names_are_an_error_not_a_silent_choice():
    with pytest.raises(ValueError, match="no known weight name"):
        optim.weight_decay_mask({"mystery": jnp.zeros(3)})


def test_schedule_warms_up_then_holds_or_decays():
    const = optim.learning_rate_schedule(OptimSection(learning_rate=1e-3, warmup_steps=10), 100)
    assert float(const(0)) == 0.0 and float(const(5)) == pytest.approx(5e-4) and float(const(50)) == pytest.approx(1e-3)
    cos = optim.learning_rate_schedule(OptimSection(learning_rate=1e-3, warmup_steps=10, schedule="cosine"), 100)
    assert float(cos(10)) == pytest.approx(1e-3) and float(cos(100)) == pytest.approx(0.0, abs=1e-9)
