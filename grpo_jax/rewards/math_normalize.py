"""Normalisation of answer text, applied alike to a model's answer and to the reference.

What is dropped or rewritten, and why, is listed in `normalize_answer`'s docstring; the number
formats ("en", "comma") are `VerifyOptions.number_format`'s. Pure string work, cached.
"""

from __future__ import annotations

import functools
import re

_UNIT_WORDS = (
    "cm|mm|km|m|kg|g|mg|s|sec|seconds|minutes|min|hours|hrs|h|days|weeks|years|"
    "dollars|cents|units|degrees|inches|inch|feet|foot|ft|meters|metres|miles|mph|"
    "liters|litres|ml|l|pounds|lbs|ounces|oz|square|sq|cubic|percentage|percent|pct"
)
_TEXT_CMDS = r"\\(?:text|textbf|textit|textrm|textnormal|mbox|mathrm|mathbf|boldsymbol)"
# A whole answer in words: `\text{Evelyn}`, `\textbf{(C)}`. It is the answer, never a unit to drop.
_WHOLE_TEXT_RE = re.compile(rf"{_TEXT_CMDS}\{{([^{{}}\\]*)\}}")
# A trailing unit: `\text{ cm}`, `\mbox{dollars}`, `\mathrm{kg}^2`, or bare `cm^2` after a number.
_TRAILING_TEXT_RE = re.compile(rf"(?<=\S)\s*{_TEXT_CMDS}\{{\s*([A-Za-z][A-Za-z .]*)\}}(?:\^\{{?[23]\}}?)?\s*$")
# A trailing modulus: `9 \pmod{11}`, `9 \pmod 11`, `9 \ (\mathrm{mod}\ 11)`: the residue is the answer.
_TRAILING_MOD_RE = re.compile(r"(?<=\S)\s*(?:\\pmod\s*\{[^{}]*\}|\\pmod\s*\d+|\(\s*\\?(?:bmod|mod)\s*\d+\s*\))\s*$")
_TRAILING_UNIT_RE = re.compile(rf"(?<=[\d}}\s])\s*(?:{_UNIT_WORDS})(?:\^\{{?[23]\}}?)?\s*$", re.ASCII)
_WRAPPER_RE = re.compile(rf"{_TEXT_CMDS}\{{([^{{}}]*)\}}")
# Words that make a trailing `\text{...}` a hedge or a sentence, not a unit: `3 \text{ or four}`.
_NOT_UNITS = frozenset(["or", "and", "nor", "not", "either", "neither", "but", "plus", "minus", "times", "over", "than", "maybe"])
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", re.ASCII)
# `1 000`, `12 345.5` (`1\ 000` and thin spaces read alike), `1 000,5` in the comma format.
_SPACED_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?: \d{3})+(?:\.\d+)?", re.ASCII)
# The comma format: `1.000.000` groups thousands (never with a leading 0: `0.125` is a decimal).
_DOTTED_THOUSANDS_RE = re.compile(r"(?<![\d.])[1-9]\d{0,2}(?:\.\d{3})+(?![\d.])", re.ASCII)
_DECIMAL_COMMA_RE = re.compile(r"(?<=\d),(?=\d)", re.ASCII)
_UNICODE = {"\u2212": "-", "\u2260": "\\neq ", "\u2248": "\\approx ", "\u2264": "\\le ", "\u2265": "\\ge ",
            "\u00a0": " ", "\u2009": " ", "\u202f": " "}
_FRACTIONS = ("\\dfrac", "\\tfrac", "\\cfrac", "\\nicefrac", "\\sfrac")
# `\left[\begin{array}{cc} 1 & 2 \end{array}\right]`: an array in brackets is a matrix.
_ARRAY_RE = re.compile(r"\\begin\{array\}\{[lcr| ]*\}")
_DELIMITERS = (("\\(", "\\)"), ("\\[", "\\]"))
_REMOVE = (
    "\\left", "\\right", "\\displaystyle", "~", "\\$", "$", "^\\circ", "^{\\circ}", "\\circ", "\\%", "%",
    "\u00b0",
)
# LaTeX spacing (`\,` `\!` `\;` `\:` `\ ` `\quad`), read left to right so a matrix row break `\\`
# followed by a space is kept.
_SPACING_RE = re.compile(r"\\\\|\\[ ,;:!]|\\q?quad(?![A-Za-z])")
# `1{,}000`, `10,\!080`, `1\,000`: commas of a number written in LaTeX (`\,` only before 3 digits).
_GROUP_SEPARATOR_RE = re.compile(r"\s*\{\s*,\s*\}\s*|,\\!\s*|(?<=\d)\\,(?=\d{3}(?!\d))", re.ASCII)


def _spacing(m: re.Match) -> str:
    """A row break stays; a negative space `\\!` vanishes; a positive one becomes a space."""
    return {"\\\\": "\\\\", "\\!": ""}.get(m.group(0), " ")


def _drop_unit(m: re.Match) -> str:
    return m.group(0) if _NOT_UNITS & set(m.group(1).lower().split()) else ""


@functools.lru_cache(maxsize=4096)  # pure; a group's G completions share one reference answer
def normalize_answer(text: str, number_format: str = "en") -> str:
    """Documented normalisation applied to both the prediction and the ground truth.

    - `\\dfrac`/`\\tfrac`/`\\cfrac`/`\\nicefrac`/`\\sfrac` -> `\\frac`; `\\begin{array}{..}` ->
      `\\begin{matrix}`; `!=` -> `\\neq`; Unicode minus, `≠ ≈ ≤ ≥` and no-break or thin spaces
      -> their ASCII forms; every other non-ASCII character is kept, and the parser then rejects
      it (look-alike digits and letters score 0);
    - dropped first, so that `$5 \\text{ cm}$` and `5 \\text{ cm}` read alike: `$`, `\\$`, `\\(...\\)`
      and `\\[...\\]` around the whole answer, `\\left`/`\\right`, LaTeX spacing (`\\,` `\\!` `\\;` `~`
      `\\quad`), the degree sign (`^\\circ`, `°`), the percent sign (`50\\%` equals `50`, not `0.5`);
      then a trailing full stop;
    - a whole answer in `\\text{...}` (or `\\textbf`, `\\mbox`, `\\mathrm`, ...) is unwrapped and kept:
      `\\text{Evelyn}` is the word answer `Evelyn` (compared as words by the verifier);
    - one trailing unit after a value is dropped (`\\text{ cm}`, `\\mbox{ inches}^2`, `cm^2`, ...),
      and so is a trailing modulus (`9 \\pmod{11}` is the residue 9),
      unless its words hedge (`3 \\text{ or four}` keeps its words, and the parser rejects them);
    - `\\text{...}` and `\\mathrm{...}` around anything else are unwrapped, so words inside them
      ("1/3 or 1/2") reach the parser and are rejected there;
    - thousands separators (number_format "en"): `1,000`, `1{,}000`, `10,\\!080` and `1 000` are one
      number only when the whole answer is one number in that form (otherwise a comma separates
      the entries of a list, so `1,2` stays the list 1, 2);
    - number_format "comma": `1,5` is 1.5, `1.000` and `1 000` group thousands, `;` separates
      entries (`(1; 2)` is the pair).
    """
    s = text.strip()
    if not s.isascii():  # the membership tests keep plain answers on the fast path (bench_verifier)
        for char, ascii_form in _UNICODE.items():
            s = s.replace(char, ascii_form)
    if "frac" in s:
        for command in _FRACTIONS:
            s = s.replace(command, "\\frac")
    if "array" in s:
        s = _ARRAY_RE.sub(r"\\begin{matrix}", s).replace("\\end{array}", "\\end{matrix}")
    s = s.replace("!=", "\\neq ")
    if number_format == "comma":
        s = _DOTTED_THOUSANDS_RE.sub(lambda m: m.group(0).replace(".", ""), s.replace("{,}", ","))
        s = _DECIMAL_COMMA_RE.sub(".", s)
    else:
        s = _GROUP_SEPARATOR_RE.sub(",", s)
    for opening, closing in _DELIMITERS:
        if s.startswith(opening) and s.endswith(closing):
            s = s[len(opening):-len(closing)]
    s = _SPACING_RE.sub(_spacing, s).replace(";", ",")  # `-12; -11` lists entries in either format
    for token in _REMOVE:
        s = s.replace(token, "")
    s = s.strip().rstrip(".").strip()
    if m := _WHOLE_TEXT_RE.fullmatch(s):
        return m.group(1).strip()
    s = _TRAILING_TEXT_RE.sub(_drop_unit, s).strip()
    s = _TRAILING_UNIT_RE.sub("", _TRAILING_MOD_RE.sub("", s)).strip()
    s = _WRAPPER_RE.sub(r"\1", s).strip()
    if number_format != "comma" and _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    elif _SPACED_THOUSANDS_RE.fullmatch(s):
        s = s.replace(" ", "")
    return s
