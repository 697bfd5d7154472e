"""Length rewards (seed Part 2, defense 3): DAPO's soft overlong penalty, and the truncation gate."""

from __future__ import annotations

from collections.abc import Sequence

from grpo_jax.rewards import calling


def soft_overlong_penalty(completion_lengths: Sequence[int], *, max_len: int, cache_len: int) -> list[float]:
    """DAPO (Yu et al. 2025, eq. 13) soft overlong punishment, one value per completion, in [-1, 0].

        L <= max_len - cache_len            ->  0
        max_len - cache_len < L <= max_len  ->  (max_len - cache_len - L) / cache_len   (linear ramp)
        L > max_len                         -> -1

    `completion_lengths` are in tokens; `cache_len` is the width of the ramp before the limit.
    """
    if max_len <= 0:
        raise ValueError(f"soft_overlong_penalty: max_len must be > 0, got {max_len}")
    if not 0 < cache_len <= max_len:
        raise ValueError(f"soft_overlong_penalty: cache_len must be in (0, max_len={max_len}], got {cache_len}")
    start = max_len - cache_len
    out = []
    for length in completion_lengths:
        if length < 0:
            raise ValueError(f"soft_overlong_penalty: completion length must be >= 0, got {length}")
        if length <= start:
            out.append(0.0)
        elif length <= max_len:
            out.append((start - length) / cache_len)
        else:
            out.append(-1.0)
    return out


def overlong_penalty_fn(max_len: int, cache_len: int):
    """A RewardFn applying `soft_overlong_penalty` to the trainer's `completion_lengths` field."""
    soft_overlong_penalty([], max_len=max_len, cache_len=cache_len)  # validate now, not at step 1

    def overlong_penalty(prompts, completions, *, completion_lengths, **_):
        return soft_overlong_penalty(completion_lengths, max_len=max_len, cache_len=cache_len)

    return overlong_penalty


def truncation_gate(values: Sequence[float | None], truncated: Sequence[bool]) -> list[float | None]:
    """A truncated completion has no final answer: it scores 0.0 whatever the verifier said.

    Untruncated values pass through unchanged (None stays None: not applicable).
    """
    if len(values) != len(truncated):
        raise ValueError(f"truncation_gate: {len(values)} values but {len(truncated)} truncated flags")
    return [0.0 if t else v for v, t in zip(values, truncated)]


def truncation_gated(fn):
    """Wraps a RewardFn so truncated completions (the trainer's `truncated` field) score 0.0."""

    def gated(prompts, completions, *, truncated, **fields):
        name = getattr(fn, "__name__", "reward")
        offered = {"prompts": prompts, "completions": completions, **fields, "truncated": truncated}
        return truncation_gate(calling.call_reward(name, fn, offered), truncated)

    gated.__name__ = f"truncation_gated_{getattr(fn, '__name__', 'reward')}"
    return gated
