"""The pure math: group-relative advantages and the other estimators, the GRPO loss and its
families (objectives), entropy control, on-policy distillation, and held-out pass@k / maj@k.
Arrays in, arrays out; nothing here imports the model, the trainer or the verifiers, so research
code can import these modules alone (the old paths `grpo_jax.losses`, `grpo_jax.advantages`,
`grpo_jax.objectives`, `grpo_jax.evaluation` still work).
"""
