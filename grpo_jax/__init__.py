"""grpo_jax: GRPO with verifiable rewards in JAX/Flax.

The packages are the layers, lowest first: `core` (the pure math), `model`, `config`,
`distributed`, `io`, `rewards`, `tasks`, `sampling`, `training`, `cli`; a module imports only its
own layer and those below (pyproject.toml's import contract). The math a researcher imports is
`grpo_jax.advantages`, `grpo_jax.losses`, `grpo_jax.objectives` (the other loss families),
`grpo_jax.advantage_estimators` and `grpo_jax.evaluation` (the modules of `grpo_jax.core` under
their first names); none of them imports the trainer, the model or the verifiers.
"""

__version__ = "0.1.0"
