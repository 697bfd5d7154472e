"""Episodes: what a multi-turn rollout plays against (environments, tools, feedback, games). The
turn loop that plays them over a sampling engine is the training layer's
(`grpo_jax.training.episode_rollout`): tasks may make environments, engines never need them.

`environment`   the interface an environment implements (`Environment`, `Reply`)
`task`          a task played as episodes (`with_environment`)
`tools`         plain functions (or a TRL environment class's methods) as tools; `tool_schema`,
                `tool_calls`: their JSON schemas and the parsing of a turn's calls
`openenv_adapter`  OpenEnv environments as ours (the `openenv` extra)
"""

from grpo_jax.episodes.environment import Environment, EpisodeError, Reply, checked_reply
from grpo_jax.episodes.task import environment_reward, with_environment
from grpo_jax.episodes.tools import ToolEnvironment, make_environment_factory

__all__ = ["Environment", "EpisodeError", "Reply", "ToolEnvironment", "checked_reply", "environment_reward",
           "make_environment_factory", "with_environment"]
