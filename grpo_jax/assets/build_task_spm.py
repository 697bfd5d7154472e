"""Builds `task_spm.model`, the small sentencepiece model shipped for the built-in tasks.

    python -m grpo_jax.assets.build_task_spm            # rewrites grpo_jax/assets/task_spm.model

The corpus is generated here from a fixed seed (arithmetic, Countdown, the R1 reasoning template and
plain English about solving problems), and training runs on one thread without sampling or
shuffling, so the same sentencepiece release writes the same bytes every time (tests check this).

Choices, and why:
- unigram model, 448 pieces (256 of them byte fallbacks): small enough for a CPU demo model's
  embedding, large enough that template words are single pieces.
- `split_digits`: every digit is its own piece, so numbers have one spelling and arithmetic rewards
  are not confounded by how a number was chunked.
- `byte_fallback`: any text (user prompts, odd unicode) encodes losslessly instead of mapping to unk.
- The R1 tags are user-defined symbols so `<answer>` is always one token the format reward can see.
- identity normalization, no dummy prefix: see the comment in `build_task_spm_bytes`.
- ids: pad 0, eos 1, bos 2, unk 3 (Gemma's order), so pad never equals eos.
"""

from __future__ import annotations

import io
import pathlib
import random

import sentencepiece as spm

VOCAB_SIZE = 448
SEED = 1234
MODEL_PATH = pathlib.Path(__file__).with_name("task_spm.model")
TAGS = ("<think>", "</think>", "<answer>", "</answer>")

_R1_SYSTEM = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think> <answer> answer here </answer>."
)
_PHRASES = (
    "Let me think step by step.", "First, add the ones digits.", "Then carry the one.",
    "So the answer is", "The result is", "We need to find a way to combine the numbers.",
    "Each number can only be used once.", "Let's check: this equals the target.",
    "That does not work, so try another combination.", "Multiply both sides by two.",
    "Subtract the smaller number from the larger one.", "Divide the total by the count.",
    "Therefore the final answer is", "What is the sum of these numbers?",
    "Compute the value of the expression.", "Show your work in <think> </think> tags and return "
    "the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.",
)

_NAMES = ("Alice", "Bob", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal")
_ITEMS = ("apples", "books", "coins", "marbles", "pencils", "stickers", "tickets", "cookies",
          "flowers", "stamps", "shells", "cards")


def corpus_lines(seed: int = SEED) -> list[str]:
    """The training text: a few thousand short lines, the same list for the same seed."""
    rng = random.Random(seed)
    lines = [_R1_SYSTEM, *_PHRASES]
    for _ in range(3000):
        a, b = rng.randrange(100), rng.randrange(100)
        lines.append(f"{a:02d}+{b:02d}={a + b}")
        lines.append(f"User: What is {a} + {b}? Assistant: <think> {a} plus {b} is {a + b} </think> "
                     f"<answer> {a + b} </answer>")
    for _ in range(1000):
        nums = [rng.randrange(1, 100) for _ in range(rng.choice((3, 4)))]
        target = rng.randrange(10, 1000)
        lines.append(f"User: Using the numbers {nums}, create an equation that equals {target}. "
                     "You can use basic arithmetic operations (+, -, *, /) and each number can only "
                     "be used once. Assistant: Let me solve this step by step. <think> "
                     f"{nums[0]} * {nums[1]} - {nums[2]} = {nums[0] * nums[1] - nums[2]} </think> "
                     f"<answer> ({nums[0]} * {nums[1]}) - {nums[2]} </answer>")
    for _ in range(1500):
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b = rng.randrange(2, 60), rng.randrange(2, 60)
        verb, op, value = rng.choice((("buys", "+", a + b), ("gives away", "-", a - b),
                                      ("gets three times", "*", a * 3)))
        lines.append(f"{name} has {a} {item} and {verb} {b} more. How many {item} does {name} "
                     f"have now? <think> {a} {op} {b} = {value} </think> <answer> {value} </answer>")
        lines.append(rng.choice(_PHRASES) + " " + rng.choice(_PHRASES))
    return lines


def build_task_spm_bytes(seed: int = SEED) -> bytes:
    """Trains the task sentencepiece model in memory and returns its serialized bytes (~1-3 s)."""
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_lines(seed)),
        model_writer=out,
        model_type="unigram",
        vocab_size=VOCAB_SIZE,
        character_coverage=1.0,
        split_digits=True,
        byte_fallback=True,
        user_defined_symbols=list(TAGS),
        pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="</s>", bos_piece="<s>", unk_piece="<unk>",
        num_threads=1,  # several threads may merge candidate pieces in a different order
        input_sentence_size=0,
        shuffle_input_sentence=False,
        # Text in, same text out: no NFKC table (it alone is ~240 KB), no added leading space, no
        # whitespace squeezing, so encode(prompt) + encode(answer) == encode(prompt + answer) for
        # the tasks' digit answers and decode(encode(s)) == s for any string.
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    return out.getvalue()


def main() -> None:
    data = build_task_spm_bytes()
    MODEL_PATH.write_bytes(data)
    print(f"wrote {MODEL_PATH} ({len(data)} bytes, vocab {VOCAB_SIZE})")


if __name__ == "__main__":
    main()
