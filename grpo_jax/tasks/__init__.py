"""Tasks: built-in generators (arithmetic, Countdown), JSONL user data, and prompt templates.

    task = make_task("arithmetic", digits=2, reverse_answer=True)
    example = task.train_example(0)     # {"prompt": "07+45=", "answer": "25", ...}
    task.reward_fns()                   # [RewardSpec("exact_match", fn, 1.0)]
"""

from __future__ import annotations

import dataclasses

from .arithmetic import ArithmeticTask
from .base import RewardSpec, Task, batched_reward
from .countdown import CountdownTask, check_countdown, parse_equation
from .jsonl import JsonlTask
from .templates import R1_SYSTEM, apply_template, plain_prompt, r1_prompt

TASKS = {"arithmetic": ArithmeticTask, "countdown": CountdownTask, "jsonl": JsonlTask}


def task_options(name: str) -> list[str]:
    """The keyword options `make_task(name, ...)` accepts."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return [f.name for f in dataclasses.fields(TASKS[name]) if f.init]


def make_task(name: str, **options) -> Task:
    """Builds the named task; unknown names and options raise ValueError listing what is allowed."""
    allowed = task_options(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"task {name!r} has no option(s) {unknown}; allowed options: {allowed}")
    return TASKS[name](**options)


__all__ = [
    "ArithmeticTask",
    "CountdownTask",
    "JsonlTask",
    "R1_SYSTEM",
    "RewardSpec",
    "TASKS",
    "Task",
    "apply_template",
    "batched_reward",
    "check_countdown",
    "make_task",
    "parse_equation",
    "plain_prompt",
    "r1_prompt",
    "task_options",
]
