"""Prompt templates, and where a completion puts its answer (`answer_location`).

Templates ("plain", "r1", "none") turn a question into the prompt the model sees:

  * "plain": the question, then one sentence saying where the answer goes.
  * "r1": DeepSeek-R1-Zero's system text, then "User: <question> <instruction>", then
    "Assistant:". It asks for the layout that `grpo_jax.rewards.format_reward` checks (seed Part 3):

        <think>
        ...reasoning...
        </think>
        <answer>
        \\boxed{1/3}
        </answer>

    The prompt ends at "Assistant:" and does not pre-fill "<think>", so the format reward sees
    every tag the model writes.
  * "none": the prompt exactly as the data has it (already formatted prompts, or messages that
    carry their own instructions).

Messages (TRL's conversational format, `[{"role": "system"|"user"|"assistant", "content": str},
...]`, ending with a user turn) are kept as messages, for the tokenizer's chat template to render:
"plain" appends the instruction to the last user turn; "r1" does the same and puts the R1 system
text in a system message first (before the conversation's own system text, in the same message,
when it has one: chat templates read only the first message as the system prompt); "none" leaves
them as they are.

Answer locations, the completion side (the reference side is `answer_format` in `jsonl.py`):

  * "boxed": exactly one `\\boxed{...}` (or `\\fbox`) in the completion; its content.
  * "gsm8k": exactly one "####" in the completion, followed by a number and nothing else on its
    line ("#### 1,000", "#### $18.50", "#### -3."); the number, thousands commas and "$" dropped.
    verl's strict GSM8K reward reads the same marker (`#### ` then digits, commas and points) but
    takes the first or last of several and compares strings; here a second marker is a hedge
    (wrong), junk after the number on its line is wrong, and the value is compared ("18.0" = 18).
  * "answer_tag": the content of the one `<answer>...</answer>` block; a single `\\boxed{}` in it
    is unwrapped (R1 models often write both).
  * "lenient": where models put answers, as lm-eval-harness and math-verify read them
    (`grpo_jax.rewards.math_locate`): the Minerva phrase ("The final answer is X. I hope it is
    correct."), else the last `\\boxed{}` (boxes in a row: one list), else "the answer is X", else
    the last displayed maths of the final sentence. A hedge ("X or maybe Y") reads as no answer.
    The prompt asks for a box, as "boxed" does. Evaluation uses it by default when training uses
    "boxed" (`eval_answer_location` in `jsonl.py`); the training reward stays strict.

With the r1 template, evaluation (`located_answer(..., template="r1")`) looks for the answer only
inside the `<answer>` block (a box in the reasoning does not count); training rewards read it
anywhere and leave the layout to the format reward.
"""

from __future__ import annotations

import re
from typing import Any

from grpo_jax.rewards import extract_boxed, lenient_answer

from .base import check_choice

TEMPLATES = ("plain", "r1", "none")
ANSWER_LOCATIONS = ("boxed", "gsm8k", "answer_tag", "lenient")
ROLES = ("system", "user", "assistant")

# Where the answer goes, appended to the question; tasks whose answer is not a math value (Countdown)
# pass their own instruction.
BOXED_INSTRUCTION = "Put the answer in \\boxed{}."
# verl's GSM8K preprocessing asks with this sentence, so figures compare with its baselines.
GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
ANSWER_TAG_INSTRUCTION = "Put the final answer inside <answer> </answer> tags."

R1_SYSTEM = (
    "A conversation between User and Assistant. The User asks a question and the Assistant "
    "solves it. The Assistant first thinks through the reasoning, then gives the answer. The "
    "reasoning goes inside <think> </think> tags and the answer inside <answer> </answer> tags, "
    "each tag on its own line:\n"
    "<think>\nreasoning here\n</think>\n<answer>\nanswer here\n</answer>"
)

# "#### " then a number (thousands grouped by commas or not, optional decimals), an optional "$"
# before it and "." after it, then the end of the line.
_HASH_ANSWER = re.compile(
    r"####[ \t]*\$?[ \t]*(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)[ \t]*\.?[ \t]*(?:\r?\n|$)", re.ASCII)


def plain_prompt(question: str, instruction: str = BOXED_INSTRUCTION) -> str:
    """'What is 7+45?' -> 'What is 7+45? Put the answer in \\boxed{}.'"""
    question = question.strip()
    return f"{question} {instruction}" if instruction else question


def r1_prompt(question: str, instruction: str = BOXED_INSTRUCTION) -> str:
    """The R1 system text, then 'User: <question> <instruction>', then 'Assistant:'."""
    return f"{R1_SYSTEM}\nUser: {plain_prompt(question, instruction)}\nAssistant:"


def apply_template(template: str, question: str, instruction: str = BOXED_INSTRUCTION) -> str:
    """Formats `question` with the named template ("plain", "r1", or "none": as it is)."""
    check_choice("template", template, TEMPLATES)
    if not isinstance(question, str):
        raise TypeError(f"question must be a str, got {type(question).__name__}")
    match template:
        case "plain":
            return plain_prompt(question, instruction)
        case "r1":
            return r1_prompt(question, instruction)
        case "none":
            return question
    raise AssertionError(template)  # unreachable: check_choice above


def messages_problem(messages: Any) -> str | None:
    """Why `messages` is not a prompt in TRL's conversational format, or None when it is one."""
    if not isinstance(messages, list) or not messages:
        return "a prompt given as messages must be a non-empty list of {\"role\", \"content\"} objects"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return f"message {i} must be an object with \"role\" and \"content\", got {str(m)[:80]!r}"
        if m["role"] not in ROLES:
            return f"message {i} has role {m['role']!r}; allowed roles: {list(ROLES)}"
        if not isinstance(m["content"], str):
            return (f"message {i}'s content must be a string, got {type(m['content']).__name__} "
                    "(content parts such as images are not supported)")
    if messages[-1]["role"] != "user":
        return f"the last message must be the user's turn, got role {messages[-1]['role']!r}"
    if not messages[-1]["content"].strip():
        return "the last user message is empty"
    return None


def apply_template_to_messages(template: str, messages: list[dict], instruction: str = BOXED_INSTRUCTION
                               ) -> list[dict]:
    """A copy of `messages` (checked by `messages_problem`) with the template applied; see the module
    docstring. The input list and its dicts are not changed."""
    check_choice("template", template, TEMPLATES)
    problem = messages_problem(messages)
    if problem is not None:
        raise ValueError(problem)
    out = [dict(m) for m in messages]
    if template == "none":
        return out
    out[-1]["content"] = plain_prompt(out[-1]["content"], instruction)
    if template == "r1":
        if out[0]["role"] == "system":
            out[0]["content"] = f"{R1_SYSTEM}\n\n{out[0]['content']}"
        else:
            out.insert(0, {"role": "system", "content": R1_SYSTEM})
    return out


def location_instruction(answer_location: str, template: str) -> str:
    """The sentence appended to a question saying where the answer goes ("" when the template
    already says it: r1's system text asks for the <answer> block)."""
    check_choice("answer_location", answer_location, ANSWER_LOCATIONS)
    match answer_location:
        case "boxed" | "lenient":
            return BOXED_INSTRUCTION
        case "gsm8k":
            return GSM8K_INSTRUCTION
        case "answer_tag":
            return "" if template == "r1" else ANSWER_TAG_INSTRUCTION
    raise AssertionError(answer_location)


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


def hash_answer(text: str) -> str | None:
    """The number after the one "####" of `text` ("#### $1,000." -> "1000"), or None: no marker,
    several (a hedge), or anything but a number on the marker's line."""
    if not isinstance(text, str) or text.count("####") != 1:
        return None
    m = _HASH_ANSWER.search(text)
    return m.group(1).replace(",", "") if m else None


def located_answer(completion: str, answer_location: str, template: str = "plain",
                   max_len: int = 20_000) -> str | None:
    """The answer text a completion gives at `answer_location`, unnormalised; None when it gives
    none (or hedges). With template "r1" the answer must sit inside the one <answer> block."""
    if not isinstance(completion, str) or len(completion) > max_len:
        return None
    if answer_location == "answer_tag" or template == "r1":
        region = answer_block(completion, max_len)
        if region is None:
            return None
    else:
        region = completion
    match answer_location:
        case "boxed":
            if completion.count("\\boxed") + completion.count("\\fbox") != 1:
                return None  # the one box of the completion must be the one in the region
            return extract_boxed(region)
        case "gsm8k":
            return hash_answer(region) if completion.count("####") == 1 else None
        case "answer_tag":
            if "\\boxed" in region or "\\fbox" in region:
                return extract_boxed(region)
            return region or None
        case "lenient":
            return lenient_answer(region)
    raise ValueError(f"answer_location={answer_location!r}; choose one of {list(ANSWER_LOCATIONS)}")
