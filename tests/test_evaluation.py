"""pass@1, pass@k and maj@k against seeds/000, Part 1 ("Evaluation: pass@1, pass@k, maj@k")."""

from math import comb

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.core.evaluation import maj_at_k, majority_answer, pass_at_1, pass_at_k


def test_seed_example_n8_c2():
    # One question, n = 8 samples, c = 2 correct: pass@1 = 2/8 = 0.25 and
    # pass@4 = 1 - C(6,4)/C(8,4) = 1 - 15/70 = 0.786.
    assert float(pass_at_1(8, 2)) == pytest.approx(0.25)
    assert float(pass_at_k(8, 2, 4)) == pytest.approx(0.786, abs=5e-4)
    assert float(pass_at_k(8, 2, 1)) == pytest.approx(0.25)  # pass@1 is pass@k with k = 1


def test_matches_binomial_formula_and_edges():
    for n, c, k in [(10, 3, 2), (16, 0, 5), (16, 16, 5), (20, 17, 4), (7, 2, 7)]:
        exact = 1 - comb(n - c, k) / comb(n, k)
        assert float(pass_at_k(n, c, k)) == pytest.approx(exact, abs=1e-6), (n, c, k)
    # n - c < k: every draw of k holds a correct sample, exactly 1.
    assert float(pass_at_k(8, 6, 4)) == 1.0


def test_stable_for_large_n():
    # n = 2000, c = 3, k = 1000: C(2000, 1000) ~ 1e600 overflows any float, but the ratio is
    # (1000 * 999 * 998) / (2000 * 1999 * 1998) = 0.12481, so pass@1000 = 0.87519.
    expected = 1 - 1000 * 999 * 998 / (2000 * 1999 * 1998)
    assert float(pass_at_k(2000, 3, 1000)) == pytest.approx(expected, abs=1e-5)


def test_vectorised_under_jit_and_dataset_mean():
    # Three questions with n = 8: c = 2, 0, 8 -> pass@4 of 0.786, 0, 1; the dataset's is the mean.
    n = jnp.array([8, 8, 8])
    c = jnp.array([2, 0, 8])
    per_question = jax.jit(pass_at_k, static_argnums=2)(n, c, 4)
    np.testing.assert_allclose(per_question, [1 - 15 / 70, 0.0, 1.0], atol=1e-6)
    assert float(per_question.mean()) == pytest.approx((1 - 15 / 70 + 1) / 3, abs=1e-6)
    np.testing.assert_allclose(jax.jit(pass_at_1)(n, c), [0.25, 0.0, 1.0])


def test_bad_counts_are_rejected():
    with pytest.raises(ValueError, match="n >= k"):
        pass_at_k(4, 1, 8)
    with pytest.raises(ValueError, match=r"c \(correct samples\) must be in \[0, n\]"):
        pass_at_k(4, 5, 2)
    with pytest.raises(ValueError, match="k must be a positive Python int"):
        pass_at_k(4, 1, 0)
    # Under jit the counts cannot be checked: n < k gives NaN instead of a wrong number.
    assert np.isnan(float(jax.jit(pass_at_k, static_argnums=2)(jnp.array(4), jnp.array(1), 8)))


def test_maj_at_k_votes_then_checks():
    # Answers "1/3", "1/2", "1/3", None, "0": "1/3" wins 2 votes to 1, and it is correct.
    answers = ["1/3", "1/2", "1/3", None, "0"]
    is_correct = lambda a: a == "1/3"  # noqa: E731
    assert maj_at_k(answers, is_correct) == 1.0
    # With k = 2 the vote is "1/3" vs "1/2", a tie: the first seen ("1/3") wins.
    assert maj_at_k(answers, is_correct, k=2) == 1.0
    assert maj_at_k(["1/2", "1/3"], is_correct, k=2) == 0.0
    # No extractable answer at all: 0, never "correct by default".
    assert maj_at_k([None, None], is_correct) == 0.0


def test_majority_uses_the_key_to_merge_equal_answers():
    # " 1/3" and "1/3" are one answer once spaces are stripped: its 2 votes beat "1/2"'s 1, even
    # though "1/2" came first.
    answers = ["1/2", " 1/3", "1/3"]
    assert majority_answer(answers) == "1/2"  # without the key, three 1-vote answers: first wins
    assert majority_answer(answers, key=str.strip) == " 1/3"
    with pytest.raises(ValueError, match=r"k must be in \[1, len\(answers\)=3\]"):
        maj_at_k(answers, bool, k=4)
