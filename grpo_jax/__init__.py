"""grpo_jax: GRPO with verifiable rewards in JAX/Flax.

The math a researcher imports lives in `grpo_jax.advantages`, `grpo_jax.losses`,
`grpo_jax.objectives` (the other loss families) and `grpo_jax.evaluation`; none of them imports
the trainer, the model or the verifiers.
"""

__version__ = "0.1.0"
