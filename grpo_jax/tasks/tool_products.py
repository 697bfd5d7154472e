"""Products with a calculator: the multi-turn CPU demo, where the tool is what makes the task solvable.

A prompt is a 2-digit product, "37*48=". A tiny model cannot multiply, but it may ask the calculator:

    prompt        37*48=
    model turn 1  ?            (then its stop token: a tool call)
    calculator    1776=        (the product, then "=": the reply is over, the model's turn starts)
    model turn 2  1776         (then its stop token: the answer, exact match against the product)

Any other first turn is the model's answer, and the episode ends there. With `tool=False` the
calculator is unavailable (`NoCalculator` ends every episode after the first turn), so the same
model, steps and budget show what the task is worth without it.

The SFT warm-up (`warmup_example`) stands in for what a pretrained model brings: half of its
examples teach the call ("37*48=" -> "?"), half teach reading a reply ("37*48=?1776=" -> "1776",
the episode's second-turn context without the stop token between, which a text prompt cannot hold).
The warm-up is cut short, so GRPO has to learn to read the calculator inside real episodes. With
`tool=False` the warm-up examples are the problems with their answers ("37*48=" -> "1776").

Held-out split: `ArithmeticTask`'s (a hash of "37*48"), so no evaluation product is ever trained on.
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

from grpo_jax.episodes.environment import Reply

from .arithmetic import ArithmeticTask, evaluate
from .base import RewardSpec, batched_reward, check_index

CALL = "?"  # the model's whole turn when it asks the calculator
END_OF_REPLY = "="  # closes the calculator's reply, so the model knows its turn begins
_PROBLEM = re.compile(r"(\d+)\*(\d+)=", re.ASCII)
_DIGITS = re.compile(r"\d{1,40}", re.ASCII)


class Calculator:
    """One episode's calculator. It reads the question from the prompt (never the answer key) and
    answers a turn that is exactly `CALL` with the product and `END_OF_REPLY`. Any other turn is the
    model's answer and ends the episode; a turn that holds `CALL` among other characters is a
    malformed call, counted in `tool_errors` and answered as an answer (wrong, so it earns 0)."""

    def __init__(self):
        self.operands: tuple[int, int] | None = None
        self.tool_calls = 0
        self.tool_errors = 0

    def reset(self, *, prompt: str, **_) -> None:
        match = _PROBLEM.fullmatch(prompt)
        if match is None:
            raise ValueError(f"Calculator: prompt {prompt!r} is not a product like '37*48='")
        self.operands = (int(match.group(1)), int(match.group(2)))
        return None

    def step(self, turn: str) -> Reply:
        if turn == CALL:
            self.tool_calls += 1
            return Reply(text=f"{evaluate(list(self.operands), ['*'])}{END_OF_REPLY}")
        if CALL in turn:
            self.tool_errors += 1
        return Reply(done=True)


class NoCalculator:
    """The tool unavailable: every episode ends after the model's first turn, which is its answer."""

    tool_calls = 0
    tool_errors = 0

    def reset(self, **_) -> None:
        return None

    def step(self, turn: str) -> Reply:
        return Reply(done=True)


@dataclasses.dataclass
class ToolProductsTask:
    """Products of two `digits`-digit numbers, played as episodes against `environment_factory`
    (`Calculator`, or `NoCalculator` when `tool=False`). Reward and held-out check: exact match of
    the episode's last model turn with the product."""

    name: ClassVar[str] = "tool_products"

    digits: int = 2
    tool: bool = True
    seed: int = 0
    eval_size: int = 500
    eval_fraction: float = 0.1

    def __post_init__(self):
        if not isinstance(self.tool, bool):
            raise ValueError(f"tool must be True or False, got {self.tool!r}")
        # Problems, their split and their answers are the arithmetic task's ("07*45=" -> "315").
        self._problems = ArithmeticTask(digits=self.digits, operators="*", template="compact", seed=self.seed,
                                        eval_size=self.eval_size, eval_fraction=self.eval_fraction)

    @property
    def environment_factory(self):
        """What each episode is played against; the trainer plays any task that has one as episodes."""
        return Calculator if self.tool else NoCalculator

    def train_example(self, index: int) -> dict:
        return self._problems.train_example(index)

    def eval_examples(self) -> list[dict]:
        return self._problems.eval_examples()

    def warmup_example(self, index: int) -> dict:
        """The SFT warm-up's example `index` (see the module docstring): with the tool, even indices
        teach the call and odd ones reading the reply; without it, the problem and its answer."""
        index = check_index(index)
        example = self._problems.train_example(index // 2 if self.tool else index)
        if not self.tool:
            return example
        if index % 2 == 0:
            return {**example, "answer": CALL}
        return {**example, "prompt": f"{example['prompt']}{CALL}{example['answer']}{END_OF_REPLY}"}

    def extract_answer(self, completion: str) -> str | None:
        """The stripped completion when it is digits (what majority voting compares), else None."""
        if not isinstance(completion, str):
            return None
        text = completion.strip()
        return text if _DIGITS.fullmatch(text) else None

    def eval_correct(self, completion: str, example: dict) -> bool:
        """Exact match of the stripped completion with the example's answer (also "?" in the
        warm-up's call examples, which is how the warm-up's validation counts them)."""
        return isinstance(completion, str) and completion.strip() == example["answer"]

    def reward_fns(self) -> list[RewardSpec]:
        def exact(completion: str, answer: str) -> float:
            return float(isinstance(completion, str) and completion.strip() == answer)

        return [RewardSpec("exact_match", batched_reward("exact_match", exact, ["answer"]), 1.0)]
