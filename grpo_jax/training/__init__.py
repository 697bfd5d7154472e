"""The GRPO run: what it is built from (run context), its state and checkpoints, the phases of one
step (rollout, scoring, reference log-probs, update), the jitted step functions, asynchronous
rollouts, length buckets, the SFT warm-up, the optimizer, and the warnings read off its metrics.
"""
