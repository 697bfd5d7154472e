"""Tokenizers as worked examples: text in, the ids (or text) expected, and why."""

import json
import re

import numpy as np
import pytest
import sentencepiece as spm

from grpo_jax.io import chat_template as ct
from grpo_jax.io import tokenizer as tk
from grpo_jax.assets import build_task_spm
from hf_fixtures import make_tiny_instruct_checkpoint


# ---------------------------------------------------------------- CharTokenizer (the CPU demo)

def test_char_tokenizer_ids_follow_symbol_order_then_eos_then_pad():
    tok = tk.CharTokenizer("0123456789+=")
    # 12 symbols + eos + pad = 14 ids, the demo's vocabulary.
    assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.bos_id) == (14, 12, 13, None)
    assert tok.encode("07+45=") == [0, 7, 10, 4, 5, 11]


def test_char_decode_skips_pad_and_stops_at_first_eos():
    tok = tk.CharTokenizer("0123456789+=")
    # pad pad '5' '2' eos '3': the '3' after eos is sampler junk and must not reach the verifier.
    assert tok.decode([13, 13, 5, 2, 12, 3]) == "52"
    assert tok.decode(np.array([5, 13, 2], dtype=np.int32)) == "52"  # pads anywhere are skipped
    assert tok.decode([12, 1]) == ""


def test_char_tokenizer_errors_name_the_bad_value():
    tok = tk.CharTokenizer("0123456789+=")
    with pytest.raises(ValueError, match="'x'"):
        tok.encode("1x2")
    assert tok.decode([1, 20]) == "1"  # out-of-vocabulary ids (padded model rows) have no text
    with pytest.raises(ValueError, match="no bos"):
        tok.encode("1", add_bos=True)
    with pytest.raises(ValueError, match=r"repeat \['1'\]"):
        tk.CharTokenizer("0112")
    with pytest.raises(ValueError, match="shape"):
        tok.decode(np.zeros((2, 3), np.int32))


def test_batch_encode_left_pads_to_longest_row():
    tok = tk.CharTokenizer("0123456789+=")
    ids, mask = tok.batch_encode(["1+2=", "10+20="])
    # Left padding: the last column is every row's last prompt token, where decoding continues.
    np.testing.assert_array_equal(ids, [[13, 13, 1, 10, 2, 11], [1, 0, 10, 2, 0, 11]])
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    assert ids.dtype == np.int32 and mask.dtype == bool


def test_batch_encode_max_len_pads_and_refuses_or_truncates_long_rows():
    tok = tk.CharTokenizer("0123456789+=")
    ids, mask = tok.batch_encode(["1="], max_len=4)
    np.testing.assert_array_equal(ids, [[13, 13, 1, 11]])
    np.testing.assert_array_equal(mask, [[False, False, True, True]])
    with pytest.raises(ValueError, match="row 0 has 6 tokens, more than max_len=4"):
        tok.batch_encode(["10+20="], max_len=4)
    # truncate keeps the end of the prompt, the part the model continues from.
    ids, mask = tok.batch_encode(["10+20="], max_len=4, truncate=True)
    np.testing.assert_array_equal(ids, [[10, 2, 0, 11]])
    assert mask.all()
    with pytest.raises(TypeError, match="list of strings"):
        tok.batch_encode("1+2=")


def test_empty_batch_and_empty_text():
    tok = tk.CharTokenizer("01")
    ids, mask = tok.batch_encode(["", "1"])
    np.testing.assert_array_equal(ids, [[3], [1]])  # pad = 3 for the empty row
    np.testing.assert_array_equal(mask, [[False], [True]])
    assert tok.batch_encode([])[0].shape == (0, 0)


# ---------------------------------------------------------------- the shipped sentencepiece model

def test_builtin_spm_ids_and_digit_splitting():
    tok = tk.load_tokenizer("builtin")
    assert isinstance(tok, tk.SentencePieceTokenizer) and isinstance(tok, tk.Tokenizer)
    # Gemma's id order, so pad (0) differs from eos (1).
    assert (tok.vocab_size, tok.pad_id, tok.eos_id, tok.bos_id) == (448, 0, 1, 2)
    ids = tok.encode("07+45=")
    # split_digits and no dummy prefix: one piece per character, so '0' and '7' are separate ids.
    assert len(ids) == 6
    assert tok.encode("0") + tok.encode("7") == ids[:2]
    assert tok.encode("07+45=", add_bos=True) == [2] + ids


def test_builtin_spm_keeps_r1_tags_whole_and_round_trips_any_text():
    tok = tk.load_tokenizer("builtin")
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        assert len(tok.encode(tag)) == 1, tag
    # byte fallback + identity normalization: unseen unicode and double spaces survive exactly.
    text = "héllo  ∑ 😀 <answer> 19 </answer>"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("52")
    assert tok.decode([0, 0, 2] + ids + [1] + tok.encode("99")) == "52"  # pad, bos dropped; eos stops


def test_builtin_spm_rebuilds_to_the_same_bytes():
    # The shipped file is exactly what the script builds; if sentencepiece changes its output, rerun
    # `python -m grpo_jax.assets.build_task_spm` and commit the new file.
    assert build_task_spm.build_task_spm_bytes() == tk.BUILTIN_SPM_PATH.read_bytes()
    assert tk.BUILTIN_SPM_PATH.stat().st_size < 200_000


@pytest.fixture(scope="module")
def llama_style_spm(tmp_path_factory):
    """A sentencepiece model laid out like Llama-2's: unk 0, bos 1, eos 2 and no pad piece."""
    path = tmp_path_factory.mktemp("spm") / "tokenizer.model"
    with open(path, "wb") as f:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(["the cat sat on the mat", "a dog ran far", "1 2 3 4"] * 20),
            model_writer=f, vocab_size=23, model_type="unigram", unk_id=0, bos_id=1, eos_id=2,
            pad_id=-1, num_threads=1, minloglevel=2)
    return path


def test_spm_without_pad_pads_with_unk(llama_style_spm):
    tok = tk.SentencePieceTokenizer(llama_style_spm)
    # No pad piece: pad = unk (0), not eos (2), so a padded row still decodes.
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 0)
    ids, mask = tok.batch_encode(["the cat", "a dog ran far"], add_bos=True)
    assert ids[0, 0] == 0 and not mask[0, 0] and ids[1, 0] == 1
    assert tok.decode(ids[0]) == "the cat"
    tok2 = tk.SentencePieceTokenizer(llama_style_spm, eos_id=3, pad_id=2)
    assert (tok2.eos_id, tok2.pad_id) == (3, 2)
    with pytest.raises(ValueError, match="pad_id=99 is outside"):
        tk.SentencePieceTokenizer(llama_style_spm, pad_id=99)


# ---------------------------------------------------------------- HF tokenizer.json

def _write_hf_tokenizer(directory, config: dict | None):
    """A word-level tokenizer.json with Qwen-like special tokens and a bos-adding post-processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, decoders

    vocab = {"<|endoftext|>": 0, "<|im_end|>": 1, "<s>": 2, "[UNK]": 3,
             "the": 4, "answer": 5, "is": 6, "42": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(["<|endoftext|>", "<|im_end|>", "<s>"])
    # Like Llama-3's: would prepend <s> if encode asked for special tokens. Ours never does.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory / "tokenizer.json"


def test_hf_tokenizer_reads_special_tokens_from_tokenizer_config(tmp_path):
    # Qwen2.5-Instruct's layout: eos <|im_end|>, pad <|endoftext|>, bos null.
    path = _write_hf_tokenizer(tmp_path / "qwen", {
        "eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"}, "bos_token": None})
    tok = tk.load_tokenizer(str(tmp_path / "qwen"))
    assert isinstance(tok, tk.HFTokenizer) and isinstance(tok, tk.Tokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.bos_id) == (8, 1, 0, None)
    assert tok.encode("the answer is 42") == [4, 5, 6, 7]  # no <s> from the post-processor
    ids, mask = tok.batch_encode(["42", "the answer is 42"])
    np.testing.assert_array_equal(ids[0], [0, 0, 0, 7])
    assert tok.decode([0, 0, 7, 1, 4]) == "42"
    with pytest.raises(ValueError, match="no bos"):
        tok.encode("the", add_bos=True)
    assert tk.load_tokenizer(str(path)).eos_id == 1


def test_hf_tokenizer_without_pad_pads_with_eos_and_still_decodes(tmp_path):
    # Llama-3's layout: bos <s>, eos <|endoftext|>, no pad token -> pad = eos.
    path = _write_hf_tokenizer(tmp_path, {"bos_token": "<s>", "eos_token": "<|endoftext|>"})
    tok = tk.HFTokenizer(path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 0, 0)
    assert tok.encode("the answer", add_bos=True) == [2, 4, 5]
    # Leading pads are dropped before looking for eos, so a left-padded row decodes.
    assert tok.decode([0, 0, 2, 6, 7, 0, 4]) == "is 42"


def test_hf_tokenizer_needs_an_eos(tmp_path):
    path = _write_hf_tokenizer(tmp_path, None)
    with pytest.raises(ValueError, match="no eos token"):
        tk.HFTokenizer(path)
    assert tk.HFTokenizer(path, eos_id=1, pad_id=0).eos_id == 1
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eot>"}))
    with pytest.raises(ValueError, match="'<eot>'"):
        tk.HFTokenizer(path)


def test_corrupt_tokenizer_files_are_named_with_line_and_column(tmp_path):
    path = _write_hf_tokenizer(tmp_path, {"eos_token": "<|im_end|>"})
    good = path.read_text()
    # Old: "Exception: EOF while parsing a value at line 1 column 28", no file named.
    path.write_text('{"version": "1.0", "model": ')  # cut off after 28 characters
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: not a readable tokenizer.json \(EOF while parsing "
                                         r"a value at line 1 column 28\)$"):
        tk.load_tokenizer(str(tmp_path))
    path.write_bytes(b"\xff\xfe garbage")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: .*UTF-8"):
        tk.HFTokenizer(path)
    path.write_text(good)
    config = tmp_path / "tokenizer_config.json"
    config.write_text('{"eos_token": ')  # old: JSONDecodeError, no file named
    with pytest.raises(ValueError, match=rf"^{re.escape(str(config))}: not valid JSON \(Expecting value at line 1, column 15\)$"):
        tk.HFTokenizer(path)
    config.write_text('"<|im_end|>"')  # old: searched the string for "eos_token", then "no eos token"
    with pytest.raises(ValueError, match=rf"^{re.escape(str(config))}: expected a JSON object, got str$"):
        tk.HFTokenizer(path)
    bad_model = tmp_path / "broken.model"
    bad_model.write_bytes(b"garbage")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(bad_model))}: not a readable sentencepiece model"):
        tk.load_tokenizer(str(bad_model))


# ---------------------------------------------------------------- load_tokenizer specs

def test_load_tokenizer_specs_and_errors(tmp_path, llama_style_spm):
    assert tk.load_tokenizer("char:ab").vocab_size == 4
    assert isinstance(tk.load_tokenizer(str(llama_style_spm)), tk.SentencePieceTokenizer)
    assert isinstance(tk.load_tokenizer(str(llama_style_spm.parent)), tk.SentencePieceTokenizer)
    with pytest.raises(FileNotFoundError, match="nope/tokenizer.model"):
        tk.load_tokenizer(str(tmp_path / "nope" / "tokenizer.model"))
    with pytest.raises(FileNotFoundError, match=f"tokenizer not found in directory {tmp_path}: no tokenizer.json"):
        tk.load_tokenizer(str(tmp_path))
    # A checkpoint with only slow-tokenizer files says what it has and how to get tokenizer.json.
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("")
    with pytest.raises(FileNotFoundError, match="not found.*holds vocab.json, merges.txt.*save_pretrained"):
        tk.load_tokenizer(str(tmp_path))
    for empty in ("", "  "):  # pathlib.Path("") is ".", the current directory: never a tokenizer
        with pytest.raises(ValueError, match="tokenizer spec is empty"):
            tk.load_tokenizer(empty)
    with pytest.raises(ValueError, match="unknown tokenizer spec 'gpt2'.*'char:<symbols>', 'builtin'"):
        tk.load_tokenizer("gpt2")
    # A missing directory (or a hub id: nothing is downloaded) is "not found" with the path.
    with pytest.raises(FileNotFoundError, match=f"tokenizer path not found: {tmp_path}/no_such_dir"):
        tk.load_tokenizer(str(tmp_path / "no_such_dir"))
    with pytest.raises(FileNotFoundError, match="tokenizer path not found: Qwen/Qwen2.5-0.5B"):
        tk.load_tokenizer("Qwen/Qwen2.5-0.5B")


def test_ids_past_the_vocabulary_decode_to_nothing():
    # A model's embedding table is often padded past its tokenizer; a sampled padding row has no
    # text and must not crash the run (it is model output, not a programming error).
    from grpo_jax.io.tokenizer import CharTokenizer, load_tokenizer
    char = CharTokenizer("0123456789+=")
    assert char.decode([1, 500, 2, char.eos_id, 3]) == "12"
    spm = load_tokenizer("builtin")
    ids = spm.encode("12+3") + [spm.vocab_size + 7]
    assert spm.decode(ids) == "12+3"


# ---------------------------------------------------------------- several stop ids

def test_completion_ids_stop_at_the_first_of_any_stop_id():
    # eos_ids (5, 6): whichever comes first ends the completion; a lone int still works.
    assert tk.completion_ids([9, 9, 1, 2, 6, 3, 5, 4], (5, 6), pad_id=9) == [1, 2]
    assert tk.completion_ids([1, 5, 2], 5, pad_id=9) == [1]


def test_eos_ids_merge_tokenizer_config_eos_with_generation_config(tmp_path):
    # Qwen2.5-Instruct: eos_token <|im_end|> (1); generation_config.json stops on [1, 0].
    path = _write_hf_tokenizer(tmp_path, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    assert tk.HFTokenizer(path).eos_ids == (1,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))
    tok = tk.HFTokenizer(path)
    assert (tok.eos_id, tok.eos_ids) == (1, (1, 0))  # eos_id stays the primary one, first
    # decode stops at either: <|endoftext|> (0) after "42" ends the text too.
    assert tok.decode([7, 0, 4]) == "42" and tok.decode([7, 1, 4]) == "42"
    # An int, and an eos_token already in the list, give no duplicates.
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert tk.HFTokenizer(path).eos_ids == (1, 0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 1]}))
    assert tk.HFTokenizer(path).eos_ids == (1, 0)


def test_eos_from_generation_config_alone_and_bad_ids_named(tmp_path):
    path = _write_hf_tokenizer(tmp_path, {"pad_token": "<|endoftext|>"})
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"eos_token_id": [1, 0]}))
    assert (tk.HFTokenizer(path).eos_id, tk.HFTokenizer(path).eos_ids) == (1, (1, 0))
    gen.write_text(json.dumps({"eos_token_id": [1, 99]}))
    with pytest.raises(ValueError, match=rf"{re.escape(str(gen))}: eos_token_id \[1, 99\] must be .* 0\.\.7"):
        tk.HFTokenizer(path)
    # Without generation_config.json, config.json's eos_token_id (transformers' fallback too).
    gen.unlink()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert tk.HFTokenizer(path).eos_ids == (0,)
    # A broken config.json is the model loader's to report (it names the file); the tokenizer
    # reads no stop ids from it and still loads.
    (tmp_path / "config.json").write_text("[1]")
    assert tk.HFTokenizer(path, eos_id=1).eos_ids == (1,)


def test_char_and_spm_tokenizers_have_one_stop_id(llama_style_spm):
    assert tk.CharTokenizer("01").eos_ids == (2,)
    assert tk.load_tokenizer("builtin").eos_ids == (1,)
    assert tk.SentencePieceTokenizer(llama_style_spm).eos_ids == (2,)


# ---------------------------------------------------------------- BOS where the tokenizer asks for it

def test_encode_prompt_follows_the_tokenizer_bos_rule(tmp_path):
    # Qwen: bos null -> prompts get none, even though the post-processor would add <s>.
    qwen = tk.HFTokenizer(_write_hf_tokenizer(tmp_path / "qwen", {"eos_token": "<|im_end|>", "bos_token": None}))
    assert (qwen.add_bos_token, qwen.encode_prompt("the answer")) == (False, [4, 5])
    # Llama 3: no add_bos_token key, and tokenizer.json's post-processor prepends <s>: so does encode_prompt.
    llama = tk.HFTokenizer(_write_hf_tokenizer(tmp_path / "llama", {"bos_token": "<s>", "eos_token": "<|endoftext|>"}))
    assert (llama.add_bos_token, llama.encode_prompt("the answer")) == (True, [2, 4, 5])
    assert llama.encode("the answer") == [4, 5]  # encode stays as it was
    # Never twice: a prompt whose text already starts with the bos keeps the one it has.
    assert llama.encode_prompt("<s> the answer") == [2, 4, 5]
    # tokenizer_config.json's add_bos_token wins over the post-processor, both ways.
    off = tk.HFTokenizer(_write_hf_tokenizer(tmp_path / "off", {"bos_token": "<s>", "eos_token": "<|im_end|>",
                                                                "add_bos_token": False}))
    assert off.encode_prompt("the") == [4]
    assert tk.HFTokenizer(off.tokenizer_json, add_bos_token=True).encode_prompt("the") == [2, 4]


def test_spm_bos_rule_from_tokenizer_config_beside_it(llama_style_spm):
    # The shipped model and a bare .model: no tokenizer_config.json, prompts get no bos.
    builtin = tk.load_tokenizer("builtin")
    assert builtin.encode_prompt("1+2=") == builtin.encode("1+2=")
    assert tk.SentencePieceTokenizer(llama_style_spm).encode_prompt("the cat")[0] != 1
    # Llama-2's checkpoint says add_bos_token true: <s> (1) first, once.
    (llama_style_spm.parent / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>"}))
    try:
        tok = tk.SentencePieceTokenizer(llama_style_spm)
        assert tok.encode_prompt("the cat") == [1] + tok.encode("the cat")
        assert tok.encode_prompt("<s>the cat") == [1] + tok.encode("the cat")  # "<s>" is bos, once
    finally:
        (llama_style_spm.parent / "tokenizer_config.json").unlink()


# ---------------------------------------------------------------- chat templates on every tokenizer

def test_tiny_instruct_checkpoint_chat_ids(tmp_path):
    path = make_tiny_instruct_checkpoint(tmp_path / "tiny")
    tok = tk.load_tokenizer(str(path))
    endoftext, im_start, im_end = (tok._tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    assert (tok.eos_id, tok.eos_ids, tok.pad_id, tok.bos_id) == (im_end, (im_end, endoftext), endoftext, None)
    chat = [{"role": "user", "content": "What is 12 + 30?"}]
    text = tok.apply_chat_template(chat, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template(chat)  # add_generation_prompt=True, tokenize=True by default
    # The template's markers are one id each, and the ids are the text's ids, nothing added.
    assert ids == tok.encode(text) and ids.count(im_start) == 3 and ids.count(im_end) == 2
    header = tok.encode("<|im_start|>assistant\n")
    assert ids[-len(header):] == header and ids[0] == im_start
    assert tok.apply_chat_template(chat, add_generation_prompt=False) == ids[:-len(header)]
    # A completion decodes up to either stop id.
    answer = tok.encode("The answer is 42.")
    assert tok.decode(answer + [im_end, 5]) == tok.decode(answer + [endoftext]) == "The answer is 42."
    # Another template by argument, and extra keywords as template variables.
    assert tok.apply_chat_template(chat, chat_template="{{ messages[0].content }}{{ x }}", x="!",
                                   tokenize=False) == "What is 12 + 30?!"


def test_llama3_template_bos_comes_once_from_the_template(tmp_path):
    # The post-processor would add <s> too (add_bos_token true), but template text is encoded with
    # nothing added: one <s>, the template's.
    path = _write_hf_tokenizer(tmp_path, {"bos_token": "<s>", "eos_token": "<|im_end|>"})
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}")
    tok = tk.HFTokenizer(path)
    assert tok.add_bos_token and tok.apply_chat_template([{"role": "user", "content": "the answer"}]) == [2, 4, 5, 1]


def test_tokenizers_without_a_template_say_where_they_looked(tmp_path, llama_style_spm):
    chat = [{"role": "user", "content": "1+1"}]
    path = _write_hf_tokenizer(tmp_path, {"eos_token": "<|im_end|>"})
    for tok, where in ((tk.HFTokenizer(path), str(tmp_path)), (tk.CharTokenizer("1+="), "CharTokenizer('1+=')"),
                       (tk.SentencePieceTokenizer(llama_style_spm), str(llama_style_spm.parent))):
        with pytest.raises(ct.ChatTemplateError, match=rf"^{re.escape(where)} has no chat template \(looked for "
                                                       r"chat_template.jinja.*plain string"):
            tok.apply_chat_template(chat)
    # A template by argument works on any tokenizer.
    assert tk.CharTokenizer("1+=").apply_chat_template(chat, chat_template="{{ messages[0].content }}=") == [0, 1, 0, 2]


def test_spm_chat_template_spells_special_tokens_and_gets_their_ids(llama_style_spm):
    # Llama-2-chat writes "<s>[INST] ..." as text; sentencepiece alone would spell "<s>" out as
    # three pieces. The rendered text maps it to bos (1), and no second bos is added.
    (llama_style_spm.parent / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{% for m in messages %}{{ bos_token }}{{ m.content }} {{ eos_token }}{% endfor %}"}))
    try:
        tok = tk.SentencePieceTokenizer(llama_style_spm)
        ids = tok.apply_chat_template([{"role": "user", "content": "the cat"}, {"role": "user", "content": "a dog"}])
        assert ids == [1, *tok.encode("the cat "), 2, 1, *tok.encode("a dog "), 2]
    finally:
        (llama_style_spm.parent / "tokenizer_config.json").unlink()


@pytest.mark.parity
def test_parity_encode_prompt_and_stop_ids_with_transformers(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer, GenerationConfig

    path = make_tiny_instruct_checkpoint(tmp_path / "tiny")
    theirs, ours = AutoTokenizer.from_pretrained(str(path)), tk.load_tokenizer(str(path))
    for text in ("The answer is 42.", "héllo  wörld\n\n 12+30=42 <|im_end|>x", ""):
        assert ours.encode_prompt(text) == theirs(text)["input_ids"]
    assert list(ours.eos_ids) == GenerationConfig.from_pretrained(str(path)).eos_token_id
    assert ours.eos_id == theirs.eos_token_id and ours.pad_id == theirs.pad_token_id
    # Llama 3's rule: no add_bos_token, a bos-prepending post-processor: transformers adds it too.
    llama = _write_hf_tokenizer(tmp_path / "llama", {"bos_token": "<s>", "eos_token": "<|endoftext|>",
                                                     "tokenizer_class": "PreTrainedTokenizerFast"})
    assert tk.HFTokenizer(llama).encode_prompt("the answer") == \
        AutoTokenizer.from_pretrained(str(llama.parent))("the answer")["input_ids"]
