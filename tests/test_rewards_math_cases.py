"""The math verifier against a labelled set of what models write (tests/data/math_answer_cases.jsonl).

Each row: a gold answer, a model's completion, whether a careful grader counts them equal
("equivalent"), the kind of answer (the issue's table: answers in prose, labelled and equation
answers, several boxes, relations, lists, number formats, approximations, units, fractions, sets,
matrices), why, and any verifier options the row is judged under (`approx_rtol`, `number_format`).
More than half are non-equivalent look-alikes: a wrong digit, a swapped pair, a hedge, a sign.
The completion is read at the lenient location, as evaluation reads it.

Bars (issue 25): agreement with the labels >= 95%, and no false positive (a look-alike scored as
right is a reward a policy would learn to collect).
"""

import collections
import json
import pathlib

import pytest

from grpo_jax.rewards import math_reward

CASES = pathlib.Path(__file__).parent / "data" / "math_answer_cases.jsonl"
FIELDS = {"kind", "gold", "completion", "equivalent", "why"}
MIN_AGREEMENT = 0.95


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    rows = []
    for n, line in enumerate(CASES.read_text(encoding="utf-8").splitlines(), 1):
        row = json.loads(line)
        assert FIELDS <= row.keys() and isinstance(row["equivalent"], bool), f"{CASES.name}, line {n}: {row}"
        rows.append(row)
    return rows


def test_the_set_has_200_cases_half_of_them_look_alikes_in_every_kind(cases):
    assert len(cases) >= 200
    assert sum(not r["equivalent"] for r in cases) >= len(cases) / 2
    by_kind = collections.defaultdict(set)
    for r in cases:
        by_kind[r["kind"]].add(r["equivalent"])
    assert all(labels == {True, False} for labels in by_kind.values()), dict(by_kind)


def test_verifier_agrees_with_the_labels_and_never_accepts_a_look_alike(cases):
    per_kind = collections.defaultdict(lambda: collections.Counter())
    misses = []
    for n, r in enumerate(cases, 1):
        got = math_reward(r["completion"], r["gold"], location="lenient", **r.get("options", {})) == 1.0
        counts = per_kind[r["kind"]]
        counts["cases"] += 1
        counts["agree"] += got == r["equivalent"]
        counts["false positives"] += got and not r["equivalent"]
        if got != r["equivalent"]:
            misses.append(f"  line {n} ({r['kind']}, labelled {r['equivalent']}): {r['why']}: "
                          f"gold {r['gold']!r}, completion ...{r['completion'][-70:]!r}")
    agree = sum(c["agree"] for c in per_kind.values())
    false_positives = sum(c["false positives"] for c in per_kind.values())
    table = "\n".join(f"  {kind:<10} {c['agree']:>3}/{c['cases']:<3} agree, {c['false positives']} false positives"
                      for kind, c in sorted(per_kind.items()))
    report = (f"{agree}/{len(cases)} = {agree / len(cases):.1%} agree, {false_positives} false positives\n"
              f"{table}\nmisses:\n" + "\n".join(misses))
    assert false_positives == 0 and agree / len(cases) >= MIN_AGREEMENT, report
