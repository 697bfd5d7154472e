"""Prompt templates: "plain" (the question plus where to put the answer) and "r1" (DeepSeek-R1-Zero).

The R1 template asks for the layout that `grpo_jax.rewards.format_reward` checks (seed Part 3):

    <think>
    ...reasoning...
    </think>
    <answer>
    \\boxed{1/3}
    </answer>

The prompt ends at "Assistant:" and does not pre-fill "<think>", so the format reward sees every
tag the model writes.
"""

from __future__ import annotations

from .base import check_choice

TEMPLATES = ("plain", "r1")

# Where the answer goes, appended to the question; tasks whose answer is not a math value (Countdown)
# pass their own instruction.
BOXED_INSTRUCTION = "Put the answer in \\boxed{}."

R1_SYSTEM = (
    "A conversation between User and Assistant. The User asks a question and the Assistant "
    "solves it. The Assistant first thinks through the reasoning, then gives the answer. The "
    "reasoning goes inside <think> </think> tags and the answer inside <answer> </answer> tags, "
    "each tag on its own line:\n"
    "<think>\nreasoning here\n</think>\n<answer>\nanswer here\n</answer>"
)


def plain_prompt(question: str, instruction: str = BOXED_INSTRUCTION) -> str:
    """'What is 7+45?' -> 'What is 7+45? Put the answer in \\boxed{}.'"""
    question = question.strip()
    return f"{question} {instruction}" if instruction else question


def r1_prompt(question: str, instruction: str = BOXED_INSTRUCTION) -> str:
    """The R1 system text, then 'User: <question> <instruction>', then 'Assistant:'."""
    return f"{R1_SYSTEM}\nUser: {plain_prompt(question, instruction)}\nAssistant:"


def apply_template(template: str, question: str, instruction: str = BOXED_INSTRUCTION) -> str:
    """Formats `question` with the named template ("plain" or "r1")."""
    check_choice("template", template, TEMPLATES)
    if not isinstance(question, str):
        raise TypeError(f"question must be a str, got {type(question).__name__}")
    match template:
        case "plain":
            return plain_prompt(question, instruction)
        case "r1":
            return r1_prompt(question, instruction)
    raise AssertionError(template)  # unreachable: check_choice above


def answer_block(completion: str, max_len: int = 10_000) -> str | None:
    """The text inside the one <answer>...</answer> block of a completion, stripped.

    None when there is no block, more than one (a hedge: two answers), an unclosed one, or the
    completion is longer than `max_len` characters (bounded work on untrusted text).
    """
    if not isinstance(completion, str) or len(completion) > max_len:
        return None
    if completion.count("<answer>") != 1 or completion.count("</answer>") != 1:
        return None
    start = completion.index("<answer>") + len("<answer>")
    end = completion.index("</answer>")
    if end < start:
        return None
    return completion[start:end].strip()
