"""Text <-> token ids behind one small interface: characters, sentencepiece, or HF tokenizer.json.

The trainer only sees `Tokenizer`:
  encode(text)                 the text's ids, nothing added (`add_bos=True` prepends bos)
  encode_prompt(text)          the ids a prompt is sampled from: bos first when the tokenizer asks
                               for one (tokenizer_config.json's add_bos_token, else tokenizer.json's
                               post-processor, as transformers decides), never twice
  apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                               the checkpoint's own chat template (`grpo_jax.io.chat_template`), ids or text
  decode(ids)                  skips pad, stops at the first of any stop id (`eos_ids`)
  batch_encode(texts)          left-padded, because the sampler appends new tokens on the right
  eos_id, eos_ids              the primary stop id, and all of them (eos_id first): Qwen2.5-Instruct
                               stops on <|im_end|> and <|endoftext|> (generation_config.json)

    load_tokenizer("char:0123456789+=")      # the CPU demo: one id per character, + eos + pad
    load_tokenizer("builtin")                # the shipped sentencepiece model for built-in tasks
    load_tokenizer("/ckpt/tokenizer.model")  # any sentencepiece model (Llama-2, Gemma, Mistral)
    load_tokenizer("/ckpt")                  # a directory with tokenizer.json (Qwen, Llama-3) or .model
"""

from __future__ import annotations

import pathlib

# The interface, the shared pieces and the file backends live in their own modules (one per
# backend); every name is importable from here, where the trainer, the tests and eval import it.
from grpo_jax.io.tokenizer_base import (  # noqa: F401
    Tokenizer,
    TokenizerMixin,
    completion_ids,
    left_pad,
)
from grpo_jax.io.tokenizer_files import read_json_object, stop_ids_beside  # noqa: F401
from grpo_jax.io.tokenizer_hf import HFTokenizer
from grpo_jax.io.tokenizer_sentencepiece import SentencePieceTokenizer

BUILTIN_SPM_PATH = pathlib.Path(__file__).parents[1] / "assets" / "task_spm.model"
_SPEC_HELP = ("'char:<symbols>', 'builtin', a sentencepiece .model file, a tokenizer.json file, "
              "or a directory holding tokenizer.json or tokenizer.model")


class CharTokenizer(TokenizerMixin):
    """One id per character of `symbols` (in order), then eos, then pad; no bos, no chat template.

    CharTokenizer("0123456789+=") has 14 ids: '0'..'9' -> 0..9, '+' -> 10, '=' -> 11, eos 12, pad 13.
    """

    def __init__(self, symbols: str):
        if not symbols:
            raise ValueError("CharTokenizer symbols must be a non-empty string, e.g. '0123456789+='")
        dupes = sorted({c for c in symbols if symbols.count(c) > 1})
        if dupes:
            raise ValueError(f"CharTokenizer symbols {symbols!r} repeat {dupes}; each character "
                             "may appear once")
        self.symbols = symbols
        self._id_of = {c: i for i, c in enumerate(symbols)}
        self.eos_id = len(symbols)
        self.eos_ids = (self.eos_id,)
        self.pad_id = len(symbols) + 1
        self.bos_id = None
        self.vocab_size = len(symbols) + 2
        self.special_tokens = {}
        self.template_home = repr(self)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        if add_bos:
            raise ValueError("CharTokenizer has no bos token; call encode with add_bos=False")
        try:
            return [self._id_of[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} in {text!r} is not one of the "
                             f"CharTokenizer symbols {self.symbols!r}") from None

    def decode(self, ids) -> str:
        out = completion_ids(ids, self.eos_ids, self.pad_id, vocab_size=len(self.symbols))
        return "".join(self.symbols[i] for i in out)

    def __repr__(self) -> str:
        return f"CharTokenizer({self.symbols!r})"


# Files that hold a tokenizer transformers can read but `tokenizers` cannot (no tokenizer.json).
_SLOW_ONLY_FILES = ("vocab.json", "merges.txt", "vocab.txt", "spiece.model", "tokenizer.tiktoken")


def load_tokenizer(spec: str) -> Tokenizer:
    """Builds a tokenizer from a spec string; see the module docstring for the accepted forms."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"tokenizer spec is empty ({spec!r}); accepted: {_SPEC_HELP}")
    if spec.startswith("char:"):
        return CharTokenizer(spec[len("char:"):])
    if spec == "builtin":
        return SentencePieceTokenizer(BUILTIN_SPM_PATH)
    path = pathlib.Path(spec)
    looks_like_path = "/" in spec or path.suffix in (".model", ".json")
    if looks_like_path and not path.exists():
        # No download: "Qwen/Qwen2.5-0.5B" is a hub id, and only local files are read.
        raise FileNotFoundError(f"tokenizer path not found: {path} (nothing is downloaded; give a "
                                "local tokenizer.json, .model file, or a directory holding one)")
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return HFTokenizer(path / "tokenizer.json")
        models = sorted(path.glob("*.model"))
        preferred = path / "tokenizer.model"
        if preferred.is_file() or models:
            return SentencePieceTokenizer(preferred if preferred.is_file() else models[0])
        slow = [name for name in _SLOW_ONLY_FILES if (path / name).is_file()]
        hint = (f"; it holds {', '.join(slow)}, which only transformers reads: write tokenizer.json "
                "with AutoTokenizer.from_pretrained(dir).save_pretrained(dir)") if slow else ""
        raise FileNotFoundError(f"tokenizer not found in directory {path}: no tokenizer.json and no "
                                f"sentencepiece .model file{hint}")
    if path.suffix == ".model":
        return SentencePieceTokenizer(path)
    if path.suffix == ".json":
        return HFTokenizer(path)
    if path.exists():
        raise ValueError(f"tokenizer file {path} is neither a .model nor a .json file; accepted: {_SPEC_HELP}")
    raise ValueError(f"unknown tokenizer spec {spec!r} (and no file or directory of that name was "
                     f"found); accepted: {_SPEC_HELP}")
