"""User data (JSONL, Parquet): answer formats and locations, prompts as text or messages, clear errors,
the held-out split (shipped eval sets with their own fields) and epoch-wise shuffling."""

import json
import sys
from pathlib import Path

import pytest

from grpo_jax.tasks import R1_SYSTEM, JsonlTask, make_task, named_eval_set
from grpo_jax.tasks.jsonl import extract_reference, last_boxed

DATA = Path(__file__).parent / "data"
GSM8K = str(DATA / "gsm8k_sample.jsonl")  # 8 questions (and one blank line)
MATH = str(DATA / "math_sample.jsonl")  # 6 problems, fields "problem" / "solution"


def write(tmp_path, text, name="d.jsonl"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --- reference answers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, answer_format, expected",
    [
        ("3 * 4 = 12.\n#### 12", "gsm8k", "12"),
        ("250 * 4 = 1000 pens.\n#### 1,000", "gsm8k", "1000"),  # thousands separator dropped
        ("so #### 3 then #### 4", "gsm8k", "4"),  # the last marker is the final answer
        ("$\\boxed{\\frac{1}{3}}$", "boxed", "\\frac{1}{3}"),  # nested braces kept
        ("first \\boxed{2}, finally \\boxed{3}", "boxed", "3"),
        ("\\boxed{2", "boxed", None),  # unclosed
        ("#### 7", "auto", "7"),
        ("\\boxed{7}", "auto", "7"),
        (" 7 ", "auto", "7"),
        ("#### 7", "raw", "#### 7"),
        ("no marker", "gsm8k", None),
    ],
)
def test_extract_reference(text, answer_format, expected):
    assert extract_reference(text, answer_format) == expected


def test_last_boxed_keeps_nested_braces():
    assert last_boxed("x \\boxed{a{b}c} y") == "a{b}c"


# --- loading ------------------------------------------------------------------------------------


def test_gsm8k_sample_loads_with_plain_prompts():
    task = JsonlTask(path=GSM8K, eval_fraction=0.0)
    assert task.num_train == 8 and task.eval_examples() == []
    by_question = {task.train_example(i)["question"]: task.train_example(i) for i in range(8)}
    pens = by_question["A shop sells 250 pens a day. How many pens does it sell in 4 days?"]
    assert pens["answer"] == "1000"
    assert pens["prompt"] == pens["question"] + " Put the answer in \\boxed{}."


def test_math_sample_with_custom_fields_and_r1_template():
    task = make_task(
        "jsonl", path=MATH, question_field="problem", answer_field="solution",
        template="r1", eval_fraction=0.0,
    )
    answers = {task.train_example(i)["problem"]: task.train_example(i) for i in range(6)}
    integral = answers["Compute $\\int_0^1 x^2\\,dx$."]
    assert integral["answer"] == "\\frac{1}{3}"
    assert integral["level"] == "Level 2"  # other record fields travel with the example
    assert integral["prompt"].endswith("Assistant:") and "<think>" in integral["prompt"]


def test_numeric_answer_field_is_accepted(tmp_path):
    path = write(tmp_path, '{"question": "1+1?", "answer": 2}\n{"question": "half?", "answer": 0.5}\n')
    task = JsonlTask(path=path, eval_fraction=0.0)
    assert sorted(task.train_example(i)["answer"] for i in range(2)) == ["0.5", "2"]


def test_missing_file_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        JsonlTask(path=missing)


def test_bad_json_names_file_and_line(tmp_path):
    path = write(tmp_path, '{"question": "a", "answer": "1"}\n\n{"question": "b", "answer": \n')
    with pytest.raises(ValueError, match=r"d\.jsonl, line 3: not valid JSON"):
        JsonlTask(path=path)


def test_missing_field_names_file_line_and_field(tmp_path):
    path = write(tmp_path, '{"question": "a", "answer": "1"}\n{"question": "b", "solution": "2"}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl, line 2: missing field 'answer'.*'solution'"):
        JsonlTask(path=path)


@pytest.mark.parametrize(
    "line, answer_format, message",
    [
        ('["a", "1"]', "auto", "expected a JSON object, got list"),
        ('{"question": "", "answer": "1"}', "auto", "'question' must be a non-empty string"),
        ('{"question": "a", "answer": null}', "auto", "'answer' must be a string or a number"),
        ('{"question": "a", "answer": "no marker"}', "gsm8k",
         "holds no final answer for answer_format='gsm8k'"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path, line, answer_format, message):
    path = write(tmp_path, '{"question": "ok", "answer": "#### 1"}\n' + line + "\n")
    with pytest.raises(ValueError) as error:
        JsonlTask(path=path, answer_format=answer_format)
    assert f"{path}, line 2: " in str(error.value) and message in str(error.value)


def test_non_utf8_bytes_name_file_line_and_byte(tmp_path):
    path = tmp_path / "latin1.jsonl"
    # "café" saved as Latin-1 on line 2. Old: "UnicodeDecodeError: 'utf-8' codec can't decode
    # byte 0xe9 in position 58", a position in the read buffer, with no file or line.
    path.write_bytes(b'{"question": "1+1?", "answer": "#### 2"}\n'
                     b'{"question": "caf\xe9 costs?", "answer": "#### 3"}\n')
    with pytest.raises(ValueError) as error:
        JsonlTask(path=str(path))
    assert str(error.value) == (
        f"{path}, line 2: not UTF-8 text (byte 0xe9 at byte 18 of the line: invalid continuation "
        "byte); re-save the file as UTF-8")
    # A UTF-8 byte-order mark on line 1 is not an error (json.loads would reject it).
    path.write_bytes(b'\xef\xbb\xbf{"question": "1+1?", "answer": "#### 2"}\n')
    assert JsonlTask(path=str(path), eval_fraction=0.0).train_example(0)["question"] == "1+1?"


def test_bad_options(tmp_path):
    with pytest.raises(ValueError, match="answer_format='latex'"):
        JsonlTask(path=GSM8K, answer_format="latex")
    with pytest.raises(ValueError, match="path"):
        JsonlTask()
    with pytest.raises(ValueError, match=r"empty"):
        JsonlTask(path=write(tmp_path, "\n\n"))


# --- split and order ----------------------------------------------------------------------------


def many_questions(tmp_path, n=200):
    lines = [f'{{"question": "What is {i} + 1?", "answer": "#### {i + 1}"}}' for i in range(n)]
    return write(tmp_path, "\n".join(lines) + "\n", "many.jsonl")


def test_eval_fraction_split_is_disjoint_and_covers_the_file(tmp_path):
    task = JsonlTask(path=many_questions(tmp_path), eval_fraction=0.2)
    eval_q = {e["question"] for e in task.eval_examples()}
    train_q = {task.train_example(i)["question"] for i in range(task.num_train)}
    assert not eval_q & train_q and len(eval_q | train_q) == 200
    assert 20 < len(eval_q) < 60  # about 40 of 200, by hash
    # Membership is a property of the question, not the seed.
    assert JsonlTask(path=task.path, eval_fraction=0.2, seed=7).eval_examples() == task.eval_examples()


def test_eval_path_drops_its_questions_from_training(tmp_path):
    train = write(tmp_path, '{"question": "a  b", "answer": "1"}\n{"question": "c", "answer": "2"}\n')
    held = write(tmp_path, '{"question": "a b", "answer": "1"}\n', "eval.jsonl")
    task = JsonlTask(path=train, eval_path=held)
    assert [e["question"] for e in task.eval_examples()] == ["a b"]
    assert task.num_train == 1 and task.train_example(0)["question"] == "c"  # "a  b" is "a b"


def test_train_order_is_an_epochwise_permutation_from_the_seed(tmp_path):
    task = JsonlTask(path=many_questions(tmp_path, 30), eval_fraction=0.0, seed=3)
    n = task.num_train
    epoch0 = [task.train_example(i)["question"] for i in range(n)]
    epoch1 = [task.train_example(i)["question"] for i in range(n, 2 * n)]
    assert sorted(epoch0) == sorted(epoch1) and len(set(epoch0)) == n  # each example once per epoch
    assert epoch0 != epoch1  # reshuffled every epoch
    fresh = JsonlTask(path=task.path, eval_fraction=0.0, seed=3)
    assert fresh.train_example(n + 5) == task.train_example(n + 5)  # random access for resumes
    other = JsonlTask(path=task.path, eval_fraction=0.0, seed=4)
    assert [other.train_example(i)["question"] for i in range(n)] != epoch0


# --- over-long prompts --------------------------------------------------------------------------


def words(text: str) -> int:
    """A stand-in tokenizer: one token per word."""
    return len(text.split())


def with_long_questions(tmp_path, long_lines=(7, 18), n=200, long_words=40_000):
    """many_questions' file with the questions on the given (1-based) lines made `long_words` long."""
    lines = [f'{{"question": "What is {i} + 1?", "answer": "#### {i + 1}"}}' for i in range(n)]
    for line in long_lines:
        i = line - 1
        lines[i] = f'{{"question": "{"very " * long_words}long {i}?", "answer": "#### {i + 1}"}}'
    return write(tmp_path, "\n".join(lines) + "\n", "long.jsonl")


def test_overlong_prompts_are_skipped_from_both_splits(tmp_path, caplog):
    # One 40,000-word question used to crash the run at the same step on every resume
    # ("prompt of 128920 tokens is longer than the largest prompt bucket").
    path = with_long_questions(tmp_path)
    task = JsonlTask(path=path, eval_fraction=0.2)
    full = JsonlTask(path=path, eval_fraction=0.2)
    in_eval = {e["question"].split()[-1] for e in full.eval_examples() if len(e["question"]) > 1000}
    assert in_eval == {"17?"}  # by hash: line 18's long question is held out, line 7's is not
    calls = []
    with caplog.at_level("WARNING", logger="grpo_jax.tasks.jsonl"):
        counts = task.check_prompt_lengths(lambda text: calls.append(text) or words(text), max_tokens=64)
    assert counts == {"train_skipped": 1, "eval_skipped": 1, "checked": 200}
    assert len(calls) == len(set(calls)) == 200  # every prompt tokenised once, nothing else
    (record,) = caplog.records  # one warning, naming the count and the file:line of each
    assert "skipped 2 over-long example(s) of 200 (training 1, held-out 1)" in record.getMessage()
    assert f"{path}:7 (40007 tokens), {path}:18 (40007 tokens)" in record.getMessage()
    assert task.num_train == full.num_train - 1
    assert len(task.eval_examples()) == len(full.eval_examples()) - 1
    # The training stream walks the kept examples: each once per epoch, none of them long, none
    # held out; and a fresh task (a resumed run) makes the same check and gets the same stream.
    n = task.num_train
    stream = [task.train_example(i)["question"] for i in range(2 * n)]
    assert sorted(stream[:n]) == sorted(stream[n:]) and len(set(stream[:n])) == n
    assert max(len(q) for q in stream) < 100
    assert not set(stream) & {e["question"] for e in task.eval_examples()}
    resumed = JsonlTask(path=path, eval_fraction=0.2)
    resumed.check_prompt_lengths(words, max_tokens=64)
    assert [resumed.train_example(i)["question"] for i in range(n + 3, n + 10)] == stream[n + 3:n + 10]
    # A second check finds nothing more to skip.
    assert task.check_prompt_lengths(words, max_tokens=64) == {
        "train_skipped": 0, "eval_skipped": 0, "checked": 198}


def test_overlong_prompt_error_names_file_line_tokens_and_limit(tmp_path):
    path = with_long_questions(tmp_path, long_lines=(7,))
    task = JsonlTask(path=path, eval_fraction=0.0, template="r1")
    limit = 40_000
    with pytest.raises(ValueError) as error:
        task.check_prompt_lengths(words, max_tokens=limit, on_overlong="error")
    tokens = max(words(task.train_example(i)["prompt"]) for i in range(task.num_train))  # line 7's
    assert tokens > limit
    assert str(error.value).startswith(
        f"{path}:7: prompt of {tokens} tokens is longer than the limit of {limit} tokens")
    assert task.num_train == 200  # nothing was dropped
    # Fitting prompts pass; the tokenizer's own error is located; bad arguments are named.
    short = JsonlTask(path=many_questions(tmp_path, 5), eval_fraction=0.0)
    assert short.check_prompt_lengths(words, 64, "error") == {
        "train_skipped": 0, "eval_skipped": 0, "checked": 5}

    def refuse(text):
        raise ValueError("character '?' is not one of the CharTokenizer symbols")
    with pytest.raises(ValueError, match=r"many\.jsonl:1: cannot tokenise the prompt \(ValueError: character"):
        short.check_prompt_lengths(refuse, 64)
    with pytest.raises(ValueError, match="on_overlong='truncate'"):
        short.check_prompt_lengths(words, 64, "truncate")
    with pytest.raises(ValueError, match="max_tokens=0"):
        short.check_prompt_lengths(words, 0)
    with pytest.raises(ValueError, match="every one of the 5 training prompts"):
        short.check_prompt_lengths(words, 2)


def test_overlong_check_with_eval_path_keeps_held_out_questions_out_of_training(tmp_path):
    long_q = "very " * 500 + "long?"
    train = write(tmp_path, f'{{"question": "{long_q}", "answer": "1"}}\n{{"question": "c", "answer": "2"}}\n'
                            '{"question": "d", "answer": "3"}\n')
    held = write(tmp_path, f'{{"question": "e", "answer": "1"}}\n{{"question": "{long_q}", "answer": "1"}}\n',
                 "eval.jsonl")
    task = JsonlTask(path=train, eval_path=held)
    assert task.check_prompt_lengths(words, 100) == {"train_skipped": 0, "eval_skipped": 1, "checked": 4}
    assert [e["question"] for e in task.eval_examples()] == ["e"]
    # The long question was held out, so it stays out of training even once it is skipped there.
    assert sorted(task.train_example(i)["question"] for i in range(task.num_train)) == ["c", "d"]


# --- checking model answers ---------------------------------------------------------------------


def math_task(template="plain"):
    return JsonlTask(path=MATH, question_field="problem", answer_field="solution",
                     template=template, eval_fraction=0.0)


@pytest.mark.parametrize(
    "completion, expected, reason",
    [
        ("so \\boxed{\\dfrac{1}{3}}", True, "\\dfrac and \\frac are the same value"),
        ("\\boxed{1/3}", True, "plain fraction"),
        ("\\boxed{0.5}", False, "wrong value"),
        ("\\boxed{1/3} or \\boxed{1/2}", False, "two boxes joined by 'or': a list of two, not 1/3"),
        ("1/3", False, "no box, no answer phrase, no maths"),
        # Evaluation reads leniently by default (the training reward below stays one box):
        ("The final answer is $\\frac{1}{3}$. I hope it is correct.", True, "the Minerva phrase"),
        ("\\boxed{1/2}, hmm, recheck the denominators ... \\boxed{1/3}", True, "the last box"),
        ("So the answer is 1/3.", True, "'the answer is'"),
    ],
)
def test_math_eval_correct(completion, expected, reason):
    task = math_task()
    example = {"answer": "\\frac{1}{3}"}
    assert task.eval_correct(completion, example) is expected, reason


def test_training_reward_stays_one_box_while_evaluation_reads_leniently():
    task = math_task()
    completions = ["So the answer is 1/3.", "\\boxed{1/2} no: \\boxed{1/3}", "\\boxed{1/3}"]
    (spec,) = task.reward_fns()
    assert spec.fn(["p"] * 3, completions, answer=["1/3"] * 3) == [0.0, 0.0, 1.0]
    assert [task.eval_correct(c, {"answer": "1/3"}) for c in completions] == [True, True, True]
    strict = JsonlTask(path=MATH, question_field="problem", answer_field="solution", eval_fraction=0.0,
                       eval_answer_location="boxed")
    assert [strict.eval_correct(c, {"answer": "1/3"}) for c in completions] == [False, False, True]
    lenient = JsonlTask(path=MATH, question_field="problem", answer_field="solution", eval_fraction=0.0,
                        answer_location="lenient")
    assert lenient.example({"question": "q?"})["prompt"] == "q? Put the answer in \\boxed{}."
    (spec,) = lenient.reward_fns()
    assert spec.fn(["p"] * 3, completions, answer=["1/3"] * 3) == [1.0, 1.0, 1.0]


def test_approx_rtol_and_number_format_reach_training_and_evaluation():
    task = JsonlTask(path=MATH, question_field="problem", answer_field="solution", eval_fraction=0.0,
                     approx_rtol=1e-3, number_format="comma")
    (spec,) = task.reward_fns()
    # 3,1416 is pi to 2.3e-6 (comma format); 0,5 is exactly 1/2; 3,2 is 1.9% from pi.
    assert spec.fn(["p"] * 3, ["\\boxed{3,1416}", "\\boxed{0,5}", "\\boxed{3,2}"],
                   answer=["\\pi", "1/2", "\\pi"]) == [1.0, 1.0, 0.0]
    assert task.eval_correct("The answer is 3,1416.", {"answer": "\\pi"})
    assert task.extract_answer("\\boxed{0,5}") == "1/2"


def test_r1_eval_needs_the_box_in_the_answer_block_and_extract_normalises():
    task = math_task("r1")
    good = "<think>\nintegrate\n</think>\n<answer>\n\\boxed{\\dfrac{1}{3}}\n</answer>"
    assert task.eval_correct(good, {"answer": "\\frac{1}{3}"})
    assert task.extract_answer(good) == "1/3"  # the exact value, so "1/3" and "\\dfrac{1}{3}" vote together
    outside = "<think>\n\\boxed{1/3}\n</think>\n<answer>\n1/3\n</answer>"
    assert not task.eval_correct(outside, {"answer": "\\frac{1}{3}"})
    assert [s.name for s in task.reward_fns()] == ["math", "format"]


def test_hostile_text_never_executes_in_jsonl(tmp_path):
    target = tmp_path / "pwned"
    payloads = [
        f"\\boxed{{__import__('os').system('touch {target}')}}",
        f"<think>\nx\n</think>\n<answer>\n\\boxed{{exec(\"open('{target}','w')\")}}\n</answer>",
    ]
    for template in ("plain", "r1"):
        task = math_task(template)
        for spec in task.reward_fns():
            scores = spec.fn(["p"] * 2, payloads, answer=["1"] * 2)
            if spec.name == "math":
                assert scores == [0.0, 0.0]
        for text in payloads:
            assert not task.eval_correct(text, {"answer": "1"})
    assert not target.exists()


def test_extract_answer_groups_equal_values_for_majority_voting():
    task = math_task()
    votes = [task.extract_answer(c) for c in ("\\boxed{0.50}", "\\boxed{\\frac{1}{2}}", "\\boxed{1/2}")]
    assert votes == ["1/2", "1/2", "1/2"]
    assert task.extract_answer("\\boxed{2 \\sqrt{2}}") == "2\\sqrt{2}"
    # Evaluation reads leniently by default: boxes in a row are one list, which votes as a list
    # (and never equals "1" or "2" alone); the strict location reads no answer at all.
    assert task.extract_answer("\\boxed{1} \\boxed{2}") == "1,2"
    strict = JsonlTask(path=MATH, question_field="problem", answer_field="solution", eval_fraction=0.0,
                       eval_answer_location="boxed")
    assert strict.extract_answer("\\boxed{1} \\boxed{2}") is None


# --- Parquet ------------------------------------------------------------------------------------


def write_parquet(tmp_path, rows, name="d.parquet"):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_parquet_loads_like_jsonl_with_custom_fields(tmp_path):
    rows = [{"problem": f"What is {i} + 1?", "solution": f"It is \\boxed{{{i + 1}}}.", "level": i % 3}
            for i in range(6)]
    path = write_parquet(tmp_path, rows)
    task = JsonlTask(path=path, question_field="problem", answer_field="solution", eval_fraction=0.0)
    got = sorted((task.train_example(i)["problem"], task.train_example(i)["answer"]) for i in range(6))
    assert got == sorted((r["problem"], str(int(r["problem"].split()[2]) + 1)) for r in rows)
    assert {task.train_example(i)["level"] for i in range(6)} == {0, 1, 2}  # other columns travel along


def test_parquet_conversational_prompts_as_datasets_writes_them(tmp_path):
    # TRL's conversational format: a list<struct<role, content>> column, as `datasets` stores it.
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i} + 1?"}],
             "answer": str(i + 1)} for i in range(3)]
    task = JsonlTask(path=write_parquet(tmp_path, rows), eval_fraction=0.0, template="r1")
    example = next(task.train_example(i) for i in range(3) if task.train_example(i)["answer"] == "1")
    assert example["question"] == "0 + 1?"
    assert [m["role"] for m in example["prompt"]] == ["system", "user"]
    assert example["prompt"][0]["content"].startswith(R1_SYSTEM) and example["prompt"][0]["content"].endswith(
        "Be brief.")
    assert example["prompt"][1]["content"] == "0 + 1? Put the answer in \\boxed{}."


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ({"question": None, "answer": "1"}, "row 2: field 'question' must be a non-empty string"),
        ({"question": "q", "answer": None}, "row 2: field 'answer' must be a string or a number"),
        ({"question": "q", "answer": "no marker"}, "row 2: field 'answer' holds no final answer"),
    ],
)
def test_parquet_bad_row_names_file_row_and_field(tmp_path, bad_row, message):
    rows = [{"question": "a", "answer": "#### 1"}, {"question": "b", "answer": "#### 2"}, bad_row]
    path = write_parquet(tmp_path, rows)
    with pytest.raises(ValueError) as error:
        JsonlTask(path=path, answer_format="gsm8k")
    assert str(error.value).startswith(f"{path}, {message}")


def test_parquet_missing_column_and_broken_file_are_named(tmp_path):
    path = write_parquet(tmp_path, [{"problem": "a", "answer": "1"}])
    with pytest.raises(ValueError, match=r"d\.parquet, row 0: missing field 'question'.*\['answer', 'problem'\]"):
        JsonlTask(path=path)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"broken\.parquet: not a readable Parquet file"):
        JsonlTask(path=str(broken))


def test_parquet_without_pyarrow_says_how_to_install_it(tmp_path, monkeypatch):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # "import pyarrow" now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"d\.parquet: reading Parquet files needs pyarrow: pip install pyarrow "
                                          r"\(or pip install 'grpo_jax\[parquet\]'\)"):
        JsonlTask(path=str(path))


# --- prompts as text or messages ------------------------------------------------------------------


def test_jsonl_messages_and_string_prompts(tmp_path):
    path = write(tmp_path, "\n".join([
        '{"prompt": [{"role": "user", "content": "What is 2+2?"}], "answer": "4"}',
        '{"prompt": "What is 3+3?", "answer": "6"}',
        '{"question": "What is 4+4?", "answer": "8"}',
    ]) + "\n")
    task = JsonlTask(path=path, eval_fraction=0.0)
    by_answer = {task.train_example(i)["answer"]: task.train_example(i) for i in range(3)}
    assert by_answer["4"]["prompt"] == [{"role": "user", "content": "What is 2+2? Put the answer in \\boxed{}."}]
    assert by_answer["4"]["question"] == "What is 2+2?"  # the split and eval_path dedup key on this
    # One prompt format per run: a file with messages asks its text rows as user turns too (chat
    # unset: auto); chat=False keeps them text.
    assert by_answer["6"]["prompt"] == [{"role": "user", "content": "What is 3+3? Put the answer in \\boxed{}."}]
    text = JsonlTask(path=path, eval_fraction=0.0, chat=False)
    by_answer_text = {text.train_example(i)["answer"]: text.train_example(i) for i in range(3)}
    assert by_answer_text["6"]["prompt"] == "What is 3+3? Put the answer in \\boxed{}."
    assert by_answer_text["8"]["prompt"] == "What is 4+4? Put the answer in \\boxed{}."
    none = JsonlTask(path=path, eval_fraction=0.0, template="none")
    assert {none.train_example(i)["answer"]: none.train_example(i)["prompt"] for i in range(3)}["4"] == [
        {"role": "user", "content": "What is 2+2?"}]
    # The task's own rewards and checks never look at the prompt, so a list is as good as text.
    for spec in task.reward_fns():
        assert spec.fn([by_answer["4"]["prompt"]], ["\\boxed{4}"], answer=["4"]) == [1.0]


def test_messages_field_is_configurable_and_bad_messages_name_file_line_and_field(tmp_path):
    path = write(tmp_path, '{"conversation": [{"role": "user", "content": "1+1?"}], "answer": "2"}\n'
                           '{"conversation": [{"role": "user", "content": "q"}, {"role": "assistant", '
                           '"content": "a"}], "answer": "3"}\n')
    with pytest.raises(ValueError) as error:
        JsonlTask(path=path, messages_field="conversation")
    assert str(error.value) == (f"{path}, line 2: field 'conversation': the last message must be the user's "
                                "turn, got role 'assistant'")
    # Without the messages field a row needs its question field; the error names both.
    with pytest.raises(ValueError, match=r"line 1: missing field 'question' \(or 'prompt' with the prompt\)"):
        JsonlTask(path=path)


# --- where the model's answer is ------------------------------------------------------------------


def gsm8k_task(**options):
    return JsonlTask(path=GSM8K, eval_fraction=0.0, answer_location="gsm8k", **options)


def test_gsm8k_answer_location_asks_trains_and_checks_with_hashes():
    task = gsm8k_task()
    example = next(task.train_example(i) for i in range(8) if task.train_example(i)["answer"] == "1000")
    assert example["prompt"].endswith(' Let\'s think step by step and output the final answer after "####".')
    good = "250 * 4 = 1000 pens.\n#### 1,000"
    assert task.eval_correct(good, example) and task.extract_answer(good) == "1000"
    assert task.eval_correct("#### 1000.00", example)  # compared by value (verl compares strings)
    for wrong in ("#### 1000\n#### 999", "\\boxed{1000}", "#### 1000 pens", "The answer is 1000."):
        assert not task.eval_correct(wrong, example) and task.extract_answer(wrong) is None, wrong
    (spec,) = task.reward_fns()
    completions = [good, "#### 999", "\\boxed{1000}", "#### 1000\n#### 999"]
    assert spec.fn(["p"] * 4, completions, answer=["1000"] * 4) == [1.0, 0.0, 0.0, 0.0]


def test_every_shipped_gsm8k_reference_solution_is_read_as_correct():
    # Real inputs: each GSM8K test solution ("... <<16-3-4=9>>9 ...\n#### 18") is a completion in
    # exactly the format answer_location="gsm8k" asks for, so every one must score 1.
    task = JsonlTask(path=named_eval_set("gsm8k"), answer_location="gsm8k", eval_fraction=0.0)
    rows = [json.loads(line) for line in Path(named_eval_set("gsm8k")).read_text().splitlines()]
    assert task.num_train == len(rows) == 1319
    (spec,) = task.reward_fns()
    examples = [task.train_example(i) for i in range(task.num_train)]
    solutions = {e["question"]: e for e in examples}
    completions = [r["answer"] for r in rows]
    answers = [solutions[r["question"]]["answer"] for r in rows]
    assert spec.fn(["p"] * len(rows), completions, answer=answers) == [1.0] * len(rows)
    assert all(task.eval_correct(c, {"answer": a}) for c, a in zip(completions, answers))


def test_answer_tag_location_with_r1_rewards_format_and_content():
    task = JsonlTask(path=GSM8K, eval_fraction=0.0, template="r1", answer_location="answer_tag")
    example = task.train_example(0)
    assert example["prompt"].endswith(f"User: {example['question']}\nAssistant:")  # R1's text says where
    good = f"<think>\nwork\n</think>\n<answer>\n{example['answer']}\n</answer>"
    boxed = f"<think>\nwork\n</think>\n<answer>\n\\boxed{{{example['answer']}}}\n</answer>"
    assert task.eval_correct(good, example) and task.eval_correct(boxed, example)
    hedge = f"<answer>\n{example['answer']}}} or {{0\n</answer>"  # braces that would close a box early
    assert not task.eval_correct(hedge, example)
    assert [s.name for s in task.reward_fns()] == ["math", "format"]
    accuracy = task.reward_fns()[0].fn(["p"] * 3, [good, boxed, hedge], answer=[example["answer"]] * 3)
    assert accuracy == [1.0, 1.0, 0.0]


def test_bad_answer_location_lists_the_choices():
    with pytest.raises(ValueError, match=r"answer_location='hash'.*\['boxed', 'gsm8k', 'answer_tag', 'lenient'\]"):
        JsonlTask(path=GSM8K, answer_location="hash")
    with pytest.raises(ValueError, match=r"eval_answer_location='last'.*'lenient'\]"):
        JsonlTask(path=GSM8K, eval_answer_location="last")
    with pytest.raises(ValueError, match=r"approx_rtol=-0.1: give a relative tolerance in \[0, 1\)"):
        JsonlTask(path=GSM8K, approx_rtol=-0.1)
    with pytest.raises(ValueError, match=r"number_format='de'; choose one of \['en', 'comma'\]"):
        JsonlTask(path=GSM8K, number_format="de")


# --- shipped eval sets and their fields -----------------------------------------------------------


def test_named_eval_sets_ship_with_their_licenses():
    path = Path(named_eval_set("gsm8k"))
    assert path.name == "gsm8k_test.jsonl" and (path.parent / "LICENSE.gsm8k").is_file()
    assert "gsm8k_test.jsonl" in (path.parent / "README.md").read_text()
    with pytest.raises(ValueError, match=r"unknown eval set 'gsm8k_test'.*\['gsm8k', 'math500'\]"):
        named_eval_set("gsm8k_test")


def test_eval_path_by_name_drops_its_questions_from_training(tmp_path):
    first = json.loads(Path(named_eval_set("gsm8k")).read_text().splitlines()[0])
    train = write(tmp_path, json.dumps(first) + "\n" + Path(GSM8K).read_text())
    task = JsonlTask(path=train, eval_path="gsm8k")
    assert len(task.eval_examples()) == 1319 and task.num_train == 8  # the test question is not trained on
    assert task.eval_examples()[0]["answer"] == "18"


def test_math500_as_eval_set_of_a_gsm8k_run_uses_its_own_fields():
    # Old: "missing field 'question'" -- the held-out file was read with the training file's fields.
    try:
        named_eval_set("math500")
    except FileNotFoundError:
        pytest.skip("grpo_jax/assets/data/math500_test.jsonl is not in this checkout yet")
    task = JsonlTask(path=GSM8K, answer_format="gsm8k", eval_path="math500")
    held_out = task.eval_examples()
    assert len(held_out) == 500 and task.num_train == 8
    assert held_out[0]["question"] == held_out[0]["problem"]
    assert held_out[0]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"  # the raw `answer` field
    assert task.eval_correct("\\boxed{\\left(3, \\frac{\\pi}{2}\\right)}", held_out[0])


def test_eval_file_with_its_own_field_names(tmp_path):
    held = write(tmp_path, '{"problem": "What is 1+1?", "final": "#### 2"}\n', "eval.jsonl")
    with pytest.raises(ValueError, match=r"eval\.jsonl, line 1: missing field 'answer'"):
        JsonlTask(path=GSM8K, eval_path=held)
    task = JsonlTask(path=GSM8K, eval_path=held, eval_question_field="problem", eval_answer_field="final",
                     eval_answer_format="gsm8k")
    assert [(e["question"], e["answer"]) for e in task.eval_examples()] == [("What is 1+1?", "2")]


def test_a_gsm8k_answer_without_hashes_among_hashed_ones_is_named_in_one_warning(tmp_path, caplog):
    # Issue 30: with answer_format="auto", the one row lacking "####" silently used its whole worked
    # solution as the reference ("5 + 2 = 7. So seven." : no completion ever equals it).
    import logging

    from grpo_jax.tasks.jsonl import Fields, read_examples

    rows = [{"question": f"{i} + 2?", "answer": f"{i} + 2 = {i + 2}.\n#### {i + 2}"} for i in range(4)]
    rows[2]["answer"] = "2 + 2 = 4. So four."
    path = tmp_path / "gsm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING, logger="grpo_jax.tasks.jsonl"):
        records = [r for _, r in read_examples(str(path), Fields())]
    assert [r["answer"] for r in records] == ["2", "3", "2 + 2 = 4. So four.", "5"]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"{path}: 1 of 4 answers (field 'answer') have no '####' although the others do, "
                              f"e.g. {path}, line 3; each is used whole")
    assert "task.options.answer_format='gsm8k' to refuse them" in warning
    # All with "####", or none (a raw-answer file): nothing to say.
    caplog.clear()
    path.write_text("".join(json.dumps({"question": "q", "answer": str(i)}) + "\n" for i in range(4)))
    with caplog.at_level(logging.WARNING, logger="grpo_jax.tasks.jsonl"):
        read_examples(str(path), Fields())
    assert caplog.records == []
