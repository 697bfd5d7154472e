"""Chat templates as worked examples: a conversation in, the exact text a checkpoint's template
gives, and why. The templates are our own, in the styles of Qwen2.5 and Llama 3 (tests/hf_fixtures.py).
Tests marked `parity` compare with transformers' own apply_chat_template when it is installed."""

import json
import re

import pytest

from grpo_jax.io import chat_template as ct
from grpo_jax.io import tokenizer as tk
from hf_fixtures import LLAMA3_STYLE_TEMPLATE, QWEN_STYLE_TEMPLATE, make_tiny_instruct_checkpoint

LLAMA3_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
QWEN_TOKENS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}

CHAT = [{"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "And 1 + 1?"}]


def render(template, conversation, **kwargs):
    return ct.render_chat_template(template, conversation, **kwargs)


# ---------------------------------------------------------------- Qwen2.5 style

def test_qwen_style_adds_the_default_system_prompt_and_the_generation_prompt():
    text = render(QWEN_STYLE_TEMPLATE, CHAT[:1], add_generation_prompt=True, special_tokens=QWEN_TOKENS)
    # No system message given: the template's default one comes first; then the user turn and the
    # assistant header the model continues from.
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_qwen_style_multi_turn_with_own_system_prompt_without_generation_prompt():
    chat = [{"role": "system", "content": "Answer with a number."}] + CHAT
    text = render(QWEN_STYLE_TEMPLATE, chat, add_generation_prompt=False, special_tokens=QWEN_TOKENS)
    # The given system prompt replaces the default (printed once, not twice); every turn keeps its
    # role; without the generation prompt the text ends after the last turn (SFT targets).
    assert text == ("<|im_start|>system\nAnswer with a number.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n"
                    "<|im_start|>assistant\n42<|im_end|>\n"
                    "<|im_start|>user\nAnd 1 + 1?<|im_end|>\n")


def test_raise_exception_on_a_bad_role_names_the_template_and_the_role():
    with pytest.raises(ct.ChatTemplateError, match=r"^qwen\.jinja refused the conversation: Unknown role: tool$"):
        render(QWEN_STYLE_TEMPLATE, [{"role": "tool", "content": "{}"}], source="qwen.jinja")


# ---------------------------------------------------------------- Llama 3 style

def test_llama3_style_writes_its_bos_and_header_ids():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hi!\n"}]
    text = render(LLAMA3_STYLE_TEMPLATE, chat, add_generation_prompt=True, special_tokens=LLAMA3_TOKENS)
    # bos once, from the template; content trimmed by `| trim`; the generation prompt is the
    # assistant header with its blank line.
    assert text == ("<|begin_of_text|>"
                    "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    without = render(LLAMA3_STYLE_TEMPLATE, chat, add_generation_prompt=False, special_tokens=LLAMA3_TOKENS)
    assert text.startswith(without) and without.endswith("Hi!<|eot_id|>")
    with pytest.raises(ct.ChatTemplateError, match="Roles must be system, user or assistant, got ipython"):
        render(LLAMA3_STYLE_TEMPLATE, [{"role": "ipython", "content": "x"}], special_tokens=LLAMA3_TOKENS)


def test_an_absent_special_token_is_undefined_not_the_string_none():
    # transformers passes only the tokens a tokenizer has: Qwen has no bos, and `{{ bos_token }}`
    # must print nothing (None would print "None"), and `is defined` must say so.
    template = "[{{ bos_token }}]{% if bos_token is defined %}yes{% else %}no{% endif %}{{ messages[0].content }}"
    assert render(template, [{"role": "user", "content": "x"}], special_tokens=QWEN_TOKENS) == "[]nox"


# ---------------------------------------------------------------- the dialect: what transformers provides

def test_globals_filters_and_extensions_transformers_templates_use():
    template = (
        "{%- set ns = namespace(n=0) %}"
        "{%- for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% if ns.n > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }};{% endgeneration %}{% endfor %}"
        "|{{ tools | tojson }}|{{ documents }}|{{ {'k': 'é<&>'} | tojson }}"
        "|{{ {'a': [1]} | tojson(indent=2) }}|{{ dict(x=1) | tojson }}|{{ flag }}|{{ strftime_now('%Y') | length }}")
    messages = [{"role": "user", "content": "a"}, {"role": "skip", "content": "b"},
                {"role": "user", "content": "c"}, {"role": "user", "content": "d"}]
    tools = [{"type": "function", "function": {"name": "add"}}]
    text = render(template, messages, tools=tools, flag=True)
    # loop controls skip "b" and stop after two; {% generation %} renders its body; tojson is plain
    # JSON, not HTML-escaped ("\u003c" for "<" is Jinja's own filter), with indent; documents None.
    assert text == ('a;c;|[{"type": "function", "function": {"name": "add"}}]|None|{"k": "é<&>"}'
                    '|{\n  "a": [\n    1\n  ]\n}|{"x": 1}|True|4')


def test_templates_cannot_reach_python_internals_or_mutate_inputs():
    user = [{"role": "user", "content": "x"}]
    for template in ("{{ ''.__class__.__mro__ }}", "{{ messages.append(1) }}",
                     "{% set ns = namespace() %}{% set ns._x = 1 %}", "{{ namespace(_y=1) }}"):
        with pytest.raises(ct.ChatTemplateError, match="refused the conversation"):
            render(template, user)
    assert user == [{"role": "user", "content": "x"}]


def test_none_values_are_dropped_and_inputs_must_be_plain_data():
    # OpenAI-style {"content": None, "tool_calls": None}: transformers drops None keys first.
    assert render("{{ messages[0] | tojson }}", [{"role": "assistant", "content": "", "tool_calls": None}]) == \
        '{"role": "assistant", "content": ""}'
    with pytest.raises(TypeError, match=r"conversation\[0\] holds a set"):
        render("{{ messages }}", [{"role": "user", "content": {1, 2}}])
    with pytest.raises(TypeError, match="list of"):
        render("{{ messages }}", "hello")
    with pytest.raises(ValueError, match="empty conversation"):
        render("{{ messages }}", [])
    with pytest.raises(ct.ChatTemplateError, match=r"^t\.jinja: not a valid Jinja template \(.* line 1\)$"):
        render("{% for %}", [{"role": "user", "content": "x"}], source="t.jinja")


# ---------------------------------------------------------------- where a checkpoint keeps its templates

def test_read_chat_templates_from_each_place_a_checkpoint_keeps_them(tmp_path):
    assert ct.read_chat_templates(tmp_path, {"eos_token": "x"}) is None
    # tokenizer_config.json: one string ...
    one = ct.read_chat_templates(tmp_path, {"chat_template": "A"})
    assert (one.select(), one.source) == ("A", str(tmp_path / "tokenizer_config.json"))
    # ... or a list of named templates (Cohere, Hermes): "default" unless tools ask for "tool_use".
    named = ct.read_chat_templates(tmp_path, {"chat_template": [
        {"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]})
    assert (named.select(), named.select(tools=[{}])) == ("D", "T")
    no_default = ct.read_chat_templates(tmp_path, {"chat_template": [{"name": "rag", "template": "R"}]})
    with pytest.raises(ct.ChatTemplateError, match=r"none is named 'default'; pass chat_template= one of \['rag'\]"):
        no_default.select()
    with pytest.raises(ct.ChatTemplateError, match=r"tokenizer_config.json: \"chat_template\" must be a string"):
        ct.read_chat_templates(tmp_path, {"chat_template": 7})
    # chat_template.jinja beside it wins over the config's entry, as in transformers.
    (tmp_path / "chat_template.jinja").write_text("J")
    jinja = ct.read_chat_templates(tmp_path, {"chat_template": "A"})
    assert (jinja.select(), jinja.source) == ("J", str(tmp_path / "chat_template.jinja"))
    (tmp_path / "chat_templates").mkdir()
    (tmp_path / "chat_templates" / "tool_use.jinja").write_text("TU")
    both = ct.read_chat_templates(tmp_path, None)
    assert dict(both.templates) == {"default": "J", "tool_use": "TU"}


def test_choose_template_by_name_by_text_or_the_tokenizers_own(tmp_path):
    named = ct.read_chat_templates(tmp_path, {"chat_template": [
        {"name": "default", "template": "D"}, {"name": "rag", "template": "R"}]})
    where = str(tmp_path / "tokenizer_config.json")
    assert ct.choose_template(named) == ("D", where)
    assert ct.choose_template(named, "rag") == ("R", f"chat template 'rag' of {where}")
    assert ct.choose_template(named, "{{ x }}") == ("{{ x }}", "the chat_template argument")
    assert ct.choose_template(None, "{{ x }}") == ("{{ x }}", "the chat_template argument")
    with pytest.raises(ct.ChatTemplateError, match=r"^/ckpt has no chat template \(looked for chat_template.jinja, "
                                                   r"chat_templates/\*.jinja and \"chat_template\" in tokenizer_config.json\); "
                                                   r"give the prompt as a plain string"):
        ct.choose_template(None, home="/ckpt")


# ---------------------------------------------------------------- parity with transformers

def _auto_tokenizer(path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


def _ids(out):
    # transformers 5 returns a BatchEncoding by default, 4.x a list of ids.
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


@pytest.mark.parity
@pytest.mark.parametrize("style", ["qwen", "llama3"])
def test_parity_with_transformers_apply_chat_template(tmp_path, style):
    path = make_tiny_instruct_checkpoint(tmp_path / "tiny")
    if style == "llama3":
        # A tokenizer-only directory (no config.json, whose model_type would make transformers pick
        # Qwen2Tokenizer): the same BPE with Llama 3's special tokens, bos, and its template in
        # chat_template.jinja.
        from hf_fixtures import train_tiny_bpe
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        path = tmp_path / "llama3"
        path.mkdir()
        tok_json = train_tiny_bpe()
        tok_json.add_special_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
        tok_json.save(str(path / "tokenizer.json"))
        cfg.pop("chat_template")
        cfg.update(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", tokenizer_class="PreTrainedTokenizerFast",
                   added_tokens_decoder={}, additional_special_tokens=[])
        (path / "tokenizer_config.json").write_text(json.dumps(cfg))
        (path / "chat_template.jinja").write_text(LLAMA3_STYLE_TEMPLATE)
    theirs = _auto_tokenizer(path)
    ours = tk.load_tokenizer(str(path))
    chats = [CHAT[:1], CHAT, [{"role": "system", "content": "Be brief, ünïcode ok."}] + CHAT,
             [{"role": "user", "content": "  spaces\n\nand 12+30=42 <|im_end|> inside  "}]]
    for chat in chats:
        for gen in (True, False):
            expected_text = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == expected_text
            expected_ids = _ids(theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen))
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == expected_ids, (chat, gen)
    if style == "llama3":
        ids = ours.apply_chat_template(CHAT)
        assert ids.count(ours.bos_id) == 1 and ids[0] == ours.bos_id  # the template's bos, once
    bad = [{"role": "tool", "content": "x"}]
    with pytest.raises(Exception, match="(?i:role)"):
        theirs.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ct.ChatTemplateError, match=re.escape(str(path)) + ".* refused the conversation: .*(?i:role)"):
        ours.apply_chat_template(bad, tokenize=False)


# -- bounds (issue 30: templates arrive inside downloaded checkpoints) ------------------------------

_HOSTILE = {
    # name: (template, what the one-line error says)
    "nested_ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                      "range() calls add up to more than 1,000,000 items"),
    "huge_power": ("{{ 10 ** (10 ** 8) }}", "10 ** 100000000 would have about 332,192,809 bits"),
    "huge_repeat": ("{{ 'x' * 10**10 }}", "repeating a value of length 1 10,000,000,000 times"),
    "gigabyte_of_loop_output": ("{% for i in range(100000) %}{{ 'y' * 10000 }}{% endfor %}",
                                "its output passed 4,000,000 characters"),
    "recursive_macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deep"),
    "wide_ljust": ("{{ 'x'.ljust(10**9) }}", "call of ljust was given the number 1000000000"),
    "wide_format": ("{{ '{:>999999999}'.format(1) }}", "a format string with a width of a million or more"),
    "wide_percent": ("{{ '%999999999d' % 1 }}", "a format string with a width of a million or more"),
    "wide_center_filter": ("{{ 'x'|center(1000000000) }}", "filter 'center' was given the number 1000000000"),
    "doubling_in_a_namespace": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}"
                                "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                                "namespace attribute 's' is 4,194,304 long"),
    "range_too_big": ("{{ range(10**6)|length }}", "Range too big"),
    "division_by_zero": ("{{ 1 // 0 }}", "ZeroDivisionError"),
}


@pytest.mark.parametrize("name", sorted(_HOSTILE))
def test_hostile_templates_stop_fast_with_one_line_naming_the_file(name):
    # Before the bounds these ran for 20+ s, until the process died of memory, or ended in a bare
    # RecursionError / OverflowError. Each is now a ChatTemplateError naming the file, in < 2 s
    # (the default time limit, which none of them needs: the guards stop them first).
    import time

    template, says = _HOSTILE[name]
    t0 = time.perf_counter()
    with pytest.raises(ct.ChatTemplateError) as err:
        ct.render_chat_template(template, [{"role": "user", "content": "hi"}], source="/ckpt/chat_template.jinja")
    assert time.perf_counter() - t0 < 2.0
    message = str(err.value)
    assert message.startswith("/ckpt/chat_template.jinja ") and says in message, message
    assert "\n" not in message


def test_a_busy_template_is_stopped_by_the_time_limit_and_the_limits_are_options():
    # A loop with no output, no call and no range(): only the watchdog can stop it. 10**9 steps of
    # Python take minutes; the limit here is 0.2 s, and the render must end well within 1 s of it.
    import time

    busy = "{% for m in messages * 100000 %}{% for c in 'abcdefghij' * 100000 %}{% endfor %}{% endfor %}"
    t0 = time.perf_counter()
    with pytest.raises(ct.ChatTemplateError, match=r"^t\.jinja took longer than 0\.2 s to render"):
        ct.render_chat_template(busy, [{"role": "user", "content": "hi"}], source="t.jinja",
                                limits=ct.RenderLimits(max_seconds=0.2))
    assert time.perf_counter() - t0 < 1.2
    # The watchdog never fires after a render that finished in time (it would hit unrelated code).
    assert render("{{ messages[0].content }}", [{"role": "user", "content": "hi"}]) == "hi"
    time.sleep(0.3)
    # max_chars is an option: 5,000,000 characters pass when it is raised (model.chat_template_max_chars).
    big = "{% for i in range(500) %}{{ 'z' * 10000 }}{% endfor %}"
    with pytest.raises(ct.ChatTemplateError, match="output passed 4,000,000"):
        ct.render_chat_template(big, [{"role": "user", "content": "hi"}])
    out = ct.render_chat_template(big, [{"role": "user", "content": "hi"}],
                                  limits=ct.RenderLimits(max_chars=6_000_000))
    assert len(out) == 5_000_000


def test_the_tokenizer_renders_under_the_configured_limits(tmp_path):
    # model.chat_template_max_chars reaches the tokenizer the trainer loads.
    from grpo_jax import config as config_lib
    from grpo_jax.training import run_context

    make_tiny_instruct_checkpoint(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ 'a' * 300 }}{{ messages[0].content }}")
    cfg = config_lib.Config(model=config_lib.ModelSection(hf_path=str(tmp_path), chat_template_max_chars=200))
    tokenizer = run_context.configured_tokenizer(cfg)
    with pytest.raises(ct.ChatTemplateError, match="chat_template.jinja was stopped: repeating a value of length 1 300 times is over the limit of 200"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
