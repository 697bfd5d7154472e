"""The model's plain full forward (every position, no cache), jitted once per graphdef: the
reference the cached decode, the Hugging Face import and the model's own tests compare with."""

import functools

import jax
from flax import nnx


@functools.partial(jax.jit, static_argnums=0)
def full_forward(graphdef, params, tokens_BxT, attention_mask_BxT, positions_BxT=None):
    """Logits [B, T, V] float32 of `nnx.merge(graphdef, params)` over all T tokens."""
    return nnx.merge(graphdef, params)(tokens_BxT, positions_BxT=positions_BxT, attention_mask_BxT=attention_mask_BxT)
