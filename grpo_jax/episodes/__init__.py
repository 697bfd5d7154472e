"""Episodes: multi-turn rollouts against an environment (tools, feedback, games).

`environment`: the interface an environment implements (`Environment`, `Reply`).
`rollout`: the turn loop over any sampling engine, and the token masks that keep environment tokens
out of the loss.
"""

from grpo_jax.episodes.environment import Environment, EpisodeError, Reply, checked_reply

__all__ = ["Environment", "EpisodeError", "Reply", "checked_reply"]
