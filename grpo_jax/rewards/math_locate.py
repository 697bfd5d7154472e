"""Where a free-form completion states its final answer: the `lenient` location (evaluation's default).

Training keeps the strict rule of `math_verify.extract_boxed` (exactly one box: the reward-hacking
defences of seed Part 2 rely on it). Evaluation reads answers where models put them, in the order
lm-eval-harness's Minerva task and math-verify look (the first rule that finds one wins):

1. the Minerva phrase, "The final answer is X. I hope it is correct." (its last occurrence);
2. the last `\\boxed{}` (or `\\fbox{}`); boxes in a row joined only by `,`, "and", "or", spacing or
   `$` are one list (`\\boxed{1}, \\boxed{2}` reads `1, 2`), so several hedged boxes never equal
   one answer (joined by "or" alone and equal by value, they are that one answer);
3. "final answer is X", "the answer is X", "Answer: X" (the last occurrence), X running to the end
   of its sentence ("Answer: the largest $n$ is X" restates a subject first); maths in X
   (`$...$`, `\\(...\\)`, `\\[...\\]`, a box) is X, several spans joined by `,`, "and" or "or" are
   a list, and a number followed by at most three plain words is the number ("the answer is 5
   apples");
4. the last displayed maths (`$...$`, `$$...$$`, `\\(...\\)`, `\\[...\\]`) of the final sentence,
   with the spans joined to it as in 3 ("So $x = 1$ or $x = 2$.").

A hedge finds nothing, and no later rule is tried: words around or between the answers of rule 3
("either $5$ or $6$", "$5$, not $6$"), or a short gap holding "or", "maybe", "not", ... between the
last two boxes or spans of rules 2 and 4. Work is linear in the completion's length, which callers
bound.
"""

from __future__ import annotations

import re

from grpo_jax.rewards.math_parse import MAX_INPUT_CHARS

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_MAX_BOXES = 1000  # more boxes than any honest completion writes
_BRACE_RE = re.compile(r"[{}]")
# Math spans, left to right. `\$` (a dollar sign in prose) is masked before this runs.
# Inline spans stay on one line, display spans may not; each at most MAX_INPUT_CHARS (bounded backtracking).
_SPAN_RE = re.compile(r"\$\$(.{1,1000}?)\$\$|\$([^$\n]{1,1000}?)\$|\\\(([^\n]{1,1000}?)\\\)|\\\[(.{1,1000}?)\\\]",
                      re.DOTALL)
_ESCAPED_DOLLAR = "\x00"
# Between two answers of one list: spacing (`\quad`, `\,`), maths delimiters, and one joining word,
# maybe in `\text{}`: `$\boxed{1}$, $\boxed{2}$`, `\boxed{1} \quad \text{and} \quad \boxed{2}`.
_SPACING = r"(?:\s|~|\\[,;: ]|\\q?quad(?![A-Za-z]))"
_DELIMS = rf"(?:{_SPACING}|\$|\\[()\[\]])*"
_WORD = r"(?:and|or)"
_JOIN = rf"(?:[,;&]{{gaps}})?(?:(?:\\(?:text|mbox)\{{{{\s*{_WORD}\s*\}}}}|{_WORD}){{gaps}})?"
_JOINER_RE = re.compile(_SPACING + "*" + _JOIN.format(gaps=_SPACING + "*"), re.IGNORECASE)
_BOX_GAP_RE = re.compile(_DELIMS + _JOIN.format(gaps=_DELIMS), re.IGNORECASE)
_OR_RE = re.compile(r"\bor\b", re.IGNORECASE)
_HEDGED = object()  # a hedge between two answers: no answer, and no later rule is tried
_MINERVA_RE = re.compile(r"final answer is\s*:?\s*(.{1,400}?)\s*\.?\s*I hope it is correct", re.IGNORECASE | re.DOTALL)
# "the answer is", "final answer is", "the answers are", "**Answer:**"
_PHRASE_RE = re.compile(r"\banswers?(?:\s*\*\*)?\s*(?:\b(?:is|are)\b\s*:?|:)(?:\s*\*\*)?", re.IGNORECASE)
# A subject restated after the phrase: "Answer: the largest $n$ is ...", "... the values are ...".
_RESTATED_RE = re.compile(r"[A-Za-z][^.!?\n=]{0,80}?\s(?:is|are|equals)\b\s*:?", re.IGNORECASE)
_SENTENCE_END_RE = re.compile(r"[.!?](?=\s)|\n\s*\n")
_NUMBER_THEN_WORDS_RE = re.compile(r"([-+]?\$?\d[\d,]*(?:\.\d+)?%?)\s+([A-Za-z]+(?:\s+[A-Za-z]+){0,2})", re.ASCII)
# Words that make "5 or 6", "5 not 6", "5 if ..." more than a number and its unit.
_NOT_UNIT_WORDS = frozenset("or and nor not either neither but plus minus times over than maybe if when "
                            "unless perhaps possibly probably approximately about".split())
# A short gap holding one of these between two answers is a hedge ("$5$ or maybe $6$", "\\boxed{5},
# not \\boxed{6}"): nothing is read, rather than the last of the two.
_HEDGE_RE = re.compile(r"\b(?:or|either|maybe|perhaps|possibly|not|but|instead)\b", re.IGNORECASE)
_HEDGE_REACH = 60  # characters; further apart, the earlier answer is working, not a hedge


def _closing_braces(text: str) -> dict[int, int]:
    """Position of each '{' -> position of its matching '}', in one pass (every brace counts, as in
    `extract_boxed`)."""
    stack: list[int] = []
    closing: dict[int, int] = {}
    for m in _BRACE_RE.finditer(text):
        if m.group(0) == "{":
            stack.append(m.start())
        elif stack:
            closing[stack.pop()] = m.start()
    return closing


def boxes(text: str) -> list[tuple[int, int, str]]:
    """Every closed `\\boxed{...}` / `\\fbox{...}`: (start, end, content stripped), left to right.

    Nested braces are matched; a box longer than MAX_INPUT_CHARS or unclosed is skipped (its
    content is not an answer). Linear in len(text).
    """
    starts = list(_BOX_RE.finditer(text))
    if not starts:
        return []
    closing = _closing_braces(text)
    found: list[tuple[int, int, str]] = []
    for m in starts:
        brace = m.end() - 1
        end = closing.get(brace)
        if end is None or end - brace > MAX_INPUT_CHARS + 1 or found and m.start() < found[-1][1]:
            continue  # unclosed, too long, or inside the previous box
        found.append((m.start(), end + 1, text[brace + 1:end].strip()))
        if len(found) >= _MAX_BOXES:
            break
    return found


def _last_boxes(text: str):
    """Rule 2: the last box, with the boxes joined to it (`\\boxed{1} and \\boxed{2}` -> "1, 2");
    None without a box, _HEDGED for a hedge."""
    found = boxes(text)
    if not found:
        return None
    return _run(text, found, _BOX_GAP_RE, whole=False, unbox=False)


def _spans(text: str) -> list[tuple[int, int, str]]:
    """Math spans (start, end, content) of `text` (with `\\$` masked), left to right."""
    return [(m.start(), m.end(), next(g for g in m.groups() if g is not None).strip())
            for m in _SPAN_RE.finditer(text)]


def _run(text: str, items: list[tuple[int, int, str]], joiner: re.Pattern, *, whole: bool,
         unbox: bool = True):
    """The last item with the items before it that only a joining word separates, as one list.

    whole: every item must be joined (an answer phrase's value); else the run stops at the first
    other gap, unless that gap is a short hedge, which reads as no answer (_HEDGED). Items joined
    only by "or" are written "a or b", which `math_read` reads as one answer when a = b by value
    ("$15\\frac{39}{40}$, or $\\frac{639}{40}$") and as a list otherwise.
    """
    run, gaps = [items[-1]], []
    for prev in reversed(items[:-1]):
        gap = text[prev[1]:run[0][0]]
        if joiner.fullmatch(gap):
            run.insert(0, prev)
            gaps.append(gap)
            continue
        if whole or len(gap) <= _HEDGE_REACH and _HEDGE_RE.search(gap):
            return _HEDGED
        break
    contents = [_unbox(c) if unbox else c for _, _, c in run]
    if not all(contents):
        return None
    return (" or " if gaps and all(_OR_RE.search(g) for g in gaps) else ", ").join(contents)


def _unbox(content: str) -> str:
    """`\\boxed{5}` inside a span -> "5" (the box is the span's whole content)."""
    found = boxes(content)
    if len(found) == 1 and found[0][0] == 0 and found[0][1] == len(content):
        return found[0][2]
    return content


def _sentence(text: str, start: int) -> str:
    """`text` from `start` (leading blank lines skipped) to the end of that sentence (spans kept whole)."""
    while start < len(text) and text[start].isspace():
        start += 1
    masked = _SPAN_RE.sub(lambda m: "M" * len(m.group(0)), text[start:])
    end = _SENTENCE_END_RE.search(masked)
    return text[start:start + end.start()] if end else text[start:]


def _phrase_value(x: str) -> str | None:
    """What follows an answer phrase, up to the end of its sentence (rule 3)."""
    x = x.strip().strip("*\"'").strip()
    if (lead := _RESTATED_RE.match(x)) is not None and not _HEDGE_RE.search(lead.group(0)):
        x = x[lead.end():].strip()  # "Final Answer: The largest $n$ is 34." -> "34"
    if not x:
        return None
    if x.startswith(("\\boxed", "\\fbox", "$\\boxed", "\\(\\boxed")) and (box := _last_boxes(x)) is not None:
        return None if box is _HEDGED else box
    spans = _spans(x)
    if spans:
        tail = x[spans[-1][1]:]
        if x[:spans[0][0]].strip(" :*\"'") or _HEDGE_RE.search(tail) or re.search(r"\d", tail):
            return None  # "not $5$ but $6$", "either $1$ or $2$", "$5$ (or 6)"
        found = _run(x, spans, _JOINER_RE, whole=True)
        return None if found is _HEDGED else found
    x = x.rstrip(" .*\"'")
    if m := _NUMBER_THEN_WORDS_RE.fullmatch(x):
        if not _NOT_UNIT_WORDS & set(m.group(2).lower().split()):
            return m.group(1)
    return x or None


def lenient_answer(text: str) -> str | None:
    """The final answer a completion states (the module docstring's rules), unnormalised; or None."""
    if not isinstance(text, str) or not text.strip():
        return None
    text = text.replace("\\$", _ESCAPED_DOLLAR)
    answer = _locate(text)
    return None if answer is None else answer.replace(_ESCAPED_DOLLAR, "\\$").strip() or None


def _locate(text: str) -> str | None:
    minerva = list(_MINERVA_RE.finditer(text))
    if minerva:
        return _phrase_value(minerva[-1].group(1))
    if (box := _last_boxes(text)) is not None:
        return None if box is _HEDGED else box
    phrases = list(_PHRASE_RE.finditer(text))
    if phrases:
        return _phrase_value(_sentence(text, phrases[-1].end()))
    return _final_sentence_math(text)


def _final_sentence_math(text: str) -> str | None:
    """Rule 4: the last maths of the final sentence, with the spans joined to it."""
    spans = _spans(text)
    if not spans:
        return None
    masked = _SPAN_RE.sub(lambda m: "M" * len(m.group(0)), text).rstrip().rstrip(".!?").rstrip()
    ends = list(_SENTENCE_END_RE.finditer(masked))
    start = ends[-1].end() if ends else 0
    inside = [s for s in spans if s[0] >= start]
    if not inside:
        return None
    found = _run(text, inside, _JOINER_RE, whole=False)
    return None if found is _HEDGED else found
