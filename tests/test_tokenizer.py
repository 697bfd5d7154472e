"""Tokenizers as worked examples: text in, the ids (or text) expected, and why."""

import json
import re

import numpy as np
import pytest
import sentencepiece as spm

from grpo_jax import tokenizer as tk
from grpo_jax.assets import build_task_spm


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
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json"):
        tk.load_tokenizer(str(tmp_path))
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
    from grpo_jax.tokenizer import CharTokenizer, load_tokenizer
    char = CharTokenizer("0123456789+=")
    assert char.decode([1, 500, 2, char.eos_id, 3]) == "12"
    spm = load_tokenizer("builtin")
    ids = spm.encode("12+3") + [spm.vocab_size + 7]
    assert spm.decode(ids) == "12+3"
