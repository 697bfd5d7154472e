"""What every task shares: the `Task` protocol, batched rewards, seeded randomness, the split hash.

A task hands the trainer examples (dicts with at least "prompt" and "answer"), the reward functions
to train on, and a stricter checker for held-out evaluation (seed Part 2, Defense 4: evaluate with a
different check than the one you train on).

A prompt is text, or a list of messages in TRL's conversational format (`[{"role": "system" |
"user" | "assistant", "content": str}, ...]`, ending with the user's turn), which the trainer
renders with the tokenizer's chat template and the generation prompt
(`grpo_jax.training.rollout.encode_prompt`). Reward functions and checkers get the prompts as the trainer
passes them; the built-in ones never read them, so either form works with them.

Randomness is derived from hashes of (task name, seed, index), never from global state, so
`train_example(i)` is random access: a resumed run asks for index i and gets exactly the example the
interrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from grpo_jax.rewards import WeightedReward

# A task's training reward: (name, fn, weight), the type `grpo_jax.rewards.compute_rewards` takes.
RewardSpec = WeightedReward

# f(prompts, completions, **example_fields) -> one reward per completion (None: not applicable).
# A prompt may be text or a list of messages (see the module docstring).
RewardFn = Callable[..., list[float | None]]


@runtime_checkable
class Task(Protocol):
    """The interface the trainer calls. Example dicts carry "prompt" (text or messages), "answer"
    and task fields.

    Optional, for tasks that read data they did not generate (JsonlTask):
    `check_prompt_lengths(count_tokens, max_tokens, on_overlong="skip") -> {"train_skipped",
    "eval_skipped", "checked"}`, which the trainer calls once at start-up, before the first
    `train_example`, when the task has it. It tokenises every prompt once and drops (or, with
    "error", names) those longer than the sampler's largest prompt bucket, so one over-long
    example cannot crash every resume at the same step. Built-in generators make prompts that fit
    by construction and leave it out; it is not part of the runtime check below.

    Optional: `warmup_example(index) -> dict`, the SFT warm-up's examples when they are not the
    training stream's (a tool task warms up on calling and reading its tool: `tasks.tool_products`).
    """

    name: str

    def train_example(self, index: int) -> dict: ...

    def eval_examples(self) -> list[dict]: ...

    def reward_fns(self) -> list[RewardSpec]: ...

    def eval_correct(self, completion: str, example: dict) -> bool: ...

    def extract_answer(self, completion: str) -> str | None: ...


def _digest(*parts: object) -> bytes:
    # "\x1f" (unit separator) keeps ("ab", "c") and ("a", "bc") apart.
    text = "\x1f".join(str(p) for p in parts)
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def unit_hash(*parts: object) -> float:
    """A deterministic number in [0, 1) for the given parts; the same on every machine and run.

    Used to decide held-out membership from the problem itself, so no seed or sampling order can
    leak an evaluation problem into training.
    """
    return int.from_bytes(_digest(*parts)[:8], "big") / 2.0**64


def example_rng(*parts: object) -> random.Random:
    """A private `random.Random` seeded from a hash of the parts (e.g. task name, seed, index)."""
    return random.Random(int.from_bytes(_digest(*parts), "big"))


def check_index(index: object) -> int:
    """`train_example` indices are non-negative ints (numpy ints accepted); anything else is an error."""
    if isinstance(index, bool) or not hasattr(index, "__index__"):
        raise TypeError(f"train_example index must be an int, got {type(index).__name__} {index!r}")
    index = int(index.__index__())
    if index < 0:
        raise ValueError(f"train_example index must be >= 0, got {index}")
    return index


def check_choice(field: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        raise ValueError(f"{field}={value!r} is not allowed; choose one of {list(allowed)}")


def check_int_range(field: str, value: object, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field} must be an int, got {type(value).__name__} {value!r}")
    if value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{field}={value} is out of range; allowed: {allowed}")


def check_fraction(field: str, value: object, *, allow_zero: bool = True) -> None:
    """Fractions of a data set: 0 <= value < 1 (1 would leave nothing to train on)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field} must be a number in [0, 1), got {value!r}")
    if not (0.0 <= value < 1.0) or (not allow_zero and value == 0.0):
        lo = "[0" if allow_zero else "(0"
        raise ValueError(f"{field}={value} is out of range; allowed: {lo}, 1)")


def check_format_weight(value: object) -> None:
    """The r1 format reward's weight lambda: 0 <= lambda < 1, so formatting never outweighs
    correctness (seed Part 3: with lambda = 2 a wrong, formatted answer beats a correct one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"format_weight={value!r}: must be a number in [0, 1) (seed Part 3, lambda < 1)")


def batched_reward(name: str, check: Callable[..., float], fields: Sequence[str]) -> RewardFn:
    """Turns a per-example scorer `check(completion, **one_example)` into a batched reward function.

    The returned `f(prompts, completions, **example_fields)` reads the listed fields (lists aligned
    with `completions`) and ignores the rest, so one trainer call can serve every task's rewards.
    """

    def reward(prompts: Sequence[str], completions: Sequence[str], **example_fields: Any):
        n = len(completions)
        columns = {}
        for field in fields:
            if field not in example_fields:
                raise ValueError(
                    f"reward {name!r} needs the example field {field!r}; "
                    f"got fields {sorted(example_fields)}"
                )
            column = example_fields[field]
            if len(column) != n:
                raise ValueError(
                    f"reward {name!r}: field {field!r} has {len(column)} entries for {n} completions"
                )
            columns[field] = column
        return [
            check(completions[i], **{f: columns[f][i] for f in fields}) for i in range(n)
        ]

    reward.__name__ = name
    reward.__qualname__ = name
    return reward
