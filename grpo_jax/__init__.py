"""grpo_jax: GRPO with verifiable rewards in JAX/Flax.

The math a researcher imports lives in `grpo_jax.core.advantages`, `grpo_jax.core.losses`,
`grpo_jax.core.objectives` (the other loss families) and `grpo_jax.core.evaluation`; none of them imports
the trainer, the model or the verifiers.
"""

__version__ = "0.1.0"
