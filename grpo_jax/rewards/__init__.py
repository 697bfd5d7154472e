"""Rewards: the strict math verifier, format and length rewards, combining, the pool, the code sandbox.

Every reward here treats model text as hostile: nothing derived from it reaches eval, exec, sympify
or parse_expr (code completions run only inside the `code` sandbox), work is bounded, and any
failure scores 0.0, never "correct".
"""

from grpo_jax.rewards.code import code_reward, code_reward_fn
from grpo_jax.rewards.combine import (
    LambdaSchedule,
    RewardFn,
    RewardInterrupted,
    RewardTimeoutError,
    WeightedReward,
    check_format_weight,
    compute_rewards,
    gate,
    penalty,
    scheduled,
    weighted_sum,
)
from grpo_jax.rewards.format import format_reward, format_reward_fn
from grpo_jax.rewards.length import overlong_penalty_fn, soft_overlong_penalty, truncation_gate, truncation_gated
from grpo_jax.rewards.math_locate import lenient_answer
from grpo_jax.rewards.math_parse import MathParseError, parse_math
from grpo_jax.rewards.math_verify import (
    LOCATIONS,
    NUMBER_FORMATS,
    VerifyOptions,
    answers_equal,
    extract_boxed,
    fast_math_reward,
    math_accuracy_reward,
    math_accuracy_reward_fn,
    math_reward,
    normalize_answer,
    verify,
    verify_options,
)
from grpo_jax.rewards.pool import VerifierPool

__all__ = [
    "LOCATIONS", "LambdaSchedule", "MathParseError", "NUMBER_FORMATS", "RewardFn", "RewardInterrupted",
    "RewardTimeoutError", "VerifierPool", "VerifyOptions", "WeightedReward", "answers_equal",
    "check_format_weight", "code_reward", "code_reward_fn", "compute_rewards", "extract_boxed",
    "fast_math_reward", "format_reward", "format_reward_fn", "gate", "lenient_answer", "math_accuracy_reward",
    "math_accuracy_reward_fn", "math_reward", "normalize_answer", "overlong_penalty_fn", "parse_math", "penalty",
    "scheduled", "soft_overlong_penalty", "truncation_gate", "truncation_gated", "verify", "verify_options",
    "weighted_sum",
]
