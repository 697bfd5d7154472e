"""Tasks: built-in generators (arithmetic, Countdown), user data (JSONL or Parquet), prompt
templates, and the eval sets shipped with grpo_jax.

    task = make_task("arithmetic", digits=2, reverse_answer=True)
    example = task.train_example(0)     # {"prompt": "07+45=", "answer": "25", ...}
    task.reward_fns()                   # [RewardSpec("exact_match", fn, 1.0)]

    task = make_task("jsonl", path="train.parquet", answer_location="gsm8k", eval_path="gsm8k")
    named_eval_set("math500")           # the path of the shipped MATH-500 file
"""

from __future__ import annotations

import dataclasses

from .arithmetic import ArithmeticTask
from .base import RewardSpec, Task, batched_reward
from .countdown import CountdownTask, check_countdown, parse_equation
from .data_files import EVAL_SETS, named_eval_set
from .jsonl import Fields, JsonlTask, read_examples
from .tool_products import ToolProductsTask
from .templates import (
    ANSWER_LOCATIONS,
    R1_SYSTEM,
    apply_template,
    apply_template_to_messages,
    located_answer,
    plain_prompt,
    r1_prompt,
)

TASKS = {"arithmetic": ArithmeticTask, "countdown": CountdownTask, "jsonl": JsonlTask,
         "tool_products": ToolProductsTask}


def task_options(name: str) -> list[str]:
    """The keyword options `make_task(name, ...)` accepts."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return [f.name for f in dataclasses.fields(TASKS[name]) if f.init]


def describe_task_options() -> str:
    """Every task's options with their defaults, one per line (for `train --help`)."""
    lines = []
    for name, cls in TASKS.items():
        lines.append(f"  task.name={name}:")
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)")
            lines.append(f"    task.options.{f.name} = {default!r}")
    return "\n".join(lines)


def make_task(name: str, **options) -> Task:
    """Builds the named task; unknown names and options raise ValueError listing what is allowed."""
    allowed = task_options(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"task {name!r} has no option(s) {unknown}; allowed options: {allowed}")
    return TASKS[name](**options)


__all__ = [
    "ANSWER_LOCATIONS",
    "EVAL_SETS",
    "R1_SYSTEM",
    "TASKS",
    "ArithmeticTask",
    "CountdownTask",
    "Fields",
    "JsonlTask",
    "RewardSpec",
    "Task",
    "ToolProductsTask",
    "apply_template",
    "apply_template_to_messages",
    "batched_reward",
    "check_countdown",
    "located_answer",
    "make_task",
    "named_eval_set",
    "parse_equation",
    "plain_prompt",
    "r1_prompt",
    "describe_task_options",
    "read_examples",
    "task_options",
]
