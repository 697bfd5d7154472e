"""The code sandbox: honest code passes the hidden tests; limits and hacks fail them."""

import pytest

from grpo_jax.rewards.code import code_reward, code_reward_fn, extract_code, parse_hidden_tests, values_equal

HIDDEN = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 20) == 30\nassert add(0, 7) == 7\n"


def test_parse_hidden_tests():
    assert parse_hidden_tests("assert f(1) == [1, 2]\nassert g('a') == {'a': (1,)}") == [
        ("f(1)", [1, 2]), ("g('a')", {"a": (1,)})]
    with pytest.raises(ValueError, match="line 2"):
        parse_hidden_tests("assert f(1) == 1\nprint('x')")
    with pytest.raises(ValueError, match="literal"):
        parse_hidden_tests("assert f(1) == g(2)")


def test_extract_code():
    assert extract_code("text\n```python\nx = 1\n```\nmore\n```python\ny = 2\n```") == "y = 2\n"  # last block
    assert extract_code("def f(): pass") == "def f(): pass"
    assert extract_code("```\nunclosed") is None


def test_values_equal_is_strict():
    assert values_equal(1.0, 1) and values_equal([1, (2, 3)], [1, (2, 3)])
    assert not values_equal(True, 1)           # a bool is not an int
    assert not values_equal([1, 2], (1, 2))    # a list is not a tuple
    assert values_equal(0.1 + 0.2, 0.3)         # floats to 1e-9 relative


def test_partial_credit_is_the_fraction_passed():
    # Correct only for non-negative inputs: 3 of the 4 hidden tests pass.
    code = "def add(a, b):\n    return a + b if a >= 0 else 5\n"
    assert code_reward(code, HIDDEN, timeout_s=3.0) == 0.75


def test_time_limit():
    code = "def add(a, b):\n    while True:\n        pass\n"
    assert code_reward(code, HIDDEN, timeout_s=1.0) == 0.0


def test_memory_limit():
    code = "def add(a, b):\n    x = bytearray(4 * 1024**3)\n    return a + b\n"
    assert code_reward(code, HIDDEN, timeout_s=3.0, memory_mb=256) == 0.0


def test_output_limit():
    code = "import sys\nsys.stdout.write('x' * (50 * 1024 * 1024))\ndef add(a, b):\n    return a + b\n"
    assert code_reward(code, HIDDEN, timeout_s=3.0, output_bytes=1 << 16) == 0.0


def test_no_network():
    code = ("import socket\ndef add(a, b):\n    socket.create_connection(('127.0.0.1', 22), timeout=0.5)\n"
            "    return a + b\n")
    assert code_reward(code, HIDDEN, timeout_s=3.0) == 0.0


def test_forged_result_lines_fail():
    # Writing extra result lines into every inherited fd does not produce a pass.
    code = ("import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'{\"ok\": [\"i\", \"5\"]}\\n')\n"
            "    except OSError:\n        pass\ndef add(a, b):\n    return 0\n")
    assert code_reward(code, HIDDEN, timeout_s=3.0) == 0.0


def test_code_reward_fn():
    assert code_reward_fn(["p"], ["def add(a, b):\n    return a + b\n"], hidden_tests=[HIDDEN]) == [1.0]
