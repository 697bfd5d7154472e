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

import json
import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from typing import Any, Protocol, runtime_checkable

import numpy as np

from grpo_jax.io import chat_template as chat

BUILTIN_SPM_PATH = pathlib.Path(__file__).parents[1] / "assets" / "task_spm.model"
_SPEC_HELP = ("'char:<symbols>', 'builtin', a sentencepiece .model file, a tokenizer.json file, "
              "or a directory holding tokenizer.json or tokenizer.model")


def read_json_object(path: str | pathlib.Path) -> dict[str, Any]:
    """The JSON object in file `path` (config.json, tokenizer_config.json, ...).

    Every failure names the file, and the line and column where there is one, in its message:
    a bare `JSONDecodeError: Expecting value: line 1 column 1` says neither which file of a
    checkpoint directory is broken nor that it is empty.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"JSON file not found: {path}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at line {line}, "
                         f"column {column})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        what = "empty file, " if not text.strip() else ""
        raise ValueError(f"{path}: not valid JSON ({what}{e.msg} at line {e.lineno}, column {e.colno})"
                         ) from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int
    eos_ids: tuple[int, ...]
    pad_id: int

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, tokenize: bool = True,
                            chat_template: str | None = None, **kwargs) -> list[int] | str: ...

    def decode(self, ids) -> str: ...

    def batch_encode(self, texts: Sequence[str], *, max_len: int | None = None,
                     add_bos: bool = False, truncate: bool = False
                     ) -> tuple[np.ndarray, np.ndarray]: ...


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, max_len: int | None = None,
             truncate: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads id lists into `ids_BxL` (int32) and `mask_BxL` (bool, True on real tokens).

    L is `max_len` when given, else the longest row. A row longer than `max_len` is an error
    unless `truncate`, which keeps its last `max_len` tokens (the end of a prompt is what the
    model continues from).
    """
    lengths = [len(r) for r in rows]
    length = max(lengths, default=0) if max_len is None else max_len
    if length < 0:
        raise ValueError(f"max_len must be >= 0, got {max_len}")
    ids_BxL = np.full((len(rows), length), pad_id, dtype=np.int32)
    mask_BxL = np.zeros((len(rows), length), dtype=bool)
    for b, row in enumerate(rows):
        if len(row) > length:
            if not truncate:
                raise ValueError(f"row {b} has {len(row)} tokens, more than max_len={length}; "
                                 "raise max_len or pass truncate=True to keep the last tokens")
            row = row[len(row) - length:]
        if len(row):
            ids_BxL[b, length - len(row):] = row
            mask_BxL[b, length - len(row):] = True
    return ids_BxL, mask_BxL


def completion_ids(ids: Iterable[int], eos_id: int | Iterable[int], pad_id: int,
                   drop: tuple[int, ...] = (), vocab_size: int | None = None) -> list[int]:
    """The ids `decode` turns into text: leading pads dropped, cut before the first stop id
    (`eos_id`: one id, or all of a tokenizer's `eos_ids`), other pads (and ids in `drop`) removed,
    and ids >= `vocab_size` removed: a model's embedding table
    is often padded past its tokenizer (Qwen2.5: 151,936 rows for 151,665 tokens), and a sampled
    padding row has no text, so it decodes to nothing rather than crashing the run.

    Leading pads go first so that a left-padded row still decodes when pad == eos (HF models
    without a pad token reuse eos).
    """
    arr = np.asarray(ids)
    if arr.ndim > 1:
        raise ValueError(f"decode takes one row of ids, got an array of shape {arr.shape}")
    flat = [int(i) for i in arr.reshape(-1)]
    stops = {int(eos_id)} if isinstance(eos_id, (int, np.integer)) else {int(i) for i in eos_id}
    start = 0
    while start < len(flat) and flat[start] == pad_id:
        start += 1
    out = []
    for i in flat[start:]:
        if i in stops:
            break
        if i != pad_id and i not in drop and (vocab_size is None or 0 <= i < vocab_size):
            out.append(i)
    return out


def stop_ids_beside(directory: str | pathlib.Path, vocab_size: int) -> list[int]:
    """The stop ids a checkpoint's generation settings list: generation_config.json's
    "eos_token_id" (an int or a list: Qwen2.5-Instruct [151645, 151643], Llama-3.1-Instruct
    [128001, 128008, 128009]); without that file, config.json's (transformers falls back to it too).
    [] when neither says; an id outside 0..vocab_size-1 is an error naming the file."""
    directory = pathlib.Path(directory)
    for name in ("generation_config.json", "config.json"):
        file = directory / name
        if not file.is_file():
            continue
        try:
            value = read_json_object(file).get("eos_token_id")
        except ValueError:
            if name == "generation_config.json":
                raise
            return []  # the model's file: hf.load_model reports it; a tokenizer need not fail on it
        ids = value if isinstance(value, list) else [] if value is None else [value]
        for tid in ids:
            if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < vocab_size:
                raise ValueError(f"{file}: eos_token_id {value!r} must be an id or a list of ids in "
                                 f"0..{vocab_size - 1} (the tokenizer's vocabulary)")
        return ids
    return []


def _unique(ids: Iterable[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(int(i) for i in ids))


class _TokenizerMixin:
    """batch_encode, encode_prompt and apply_chat_template on top of a class's `encode`.

    A class sets `pad_id`, `bos_id`, `add_bos_token` (its BOS rule for prompts), `chat_templates`
    (None: none found), `special_tokens` (name -> string, what templates see as `bos_token` ...),
    `template_home` (where templates were looked for, for the error) and may override
    `_encode_rendered` (how rendered template text, special tokens spelled out, becomes ids).
    """

    pad_id: int
    bos_id: int | None
    add_bos_token: bool = False
    chat_templates: chat.ChatTemplates | None = None
    chat_template_limits: chat.RenderLimits | None = None  # None: chat_template_bounds.DEFAULT_LIMITS
    special_tokens: Mapping[str, str]
    template_home: str

    def batch_encode(self, texts: Sequence[str], *, max_len: int | None = None,
                     add_bos: bool = False, truncate: bool = False
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Encodes `texts` into left-padded `ids_BxL` (int32) and `mask_BxL` (bool)."""
        if isinstance(texts, str):
            raise TypeError("batch_encode takes a list of strings, got one str; wrap it in a list")
        rows = [self.encode(t, add_bos=add_bos) for t in texts]  # type: ignore[attr-defined]
        return left_pad(rows, self.pad_id, max_len, truncate)

    def encode_prompt(self, text: str) -> list[int]:
        """The ids a prompt is sampled from: the text's ids (special tokens written in it, such as
        "<s>", are their ids, as transformers reads them), with bos prepended when this tokenizer
        asks for one (`add_bos_token`) and the text does not already begin with it."""
        ids = self._encode_rendered(text)
        if self.add_bos_token and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def _encode_rendered(self, text: str) -> list[int]:
        return self.encode(text)  # type: ignore[attr-defined]

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, tokenize: bool = True,
                            chat_template: str | None = None, tools: Sequence | None = None,
                            documents: Sequence | None = None, **kwargs) -> list[int] | str:
        """transformers' `apply_chat_template` for one conversation ([{"role", "content"}, ...]).

        Renders this tokenizer's own chat template (or `chat_template`: a template's name, or a
        Jinja template) with the generation prompt (the assistant header the model continues
        from) when `add_generation_prompt`; extra keywords are template variables. Returns the
        ids (tokenize=True: the text encoded with no special tokens added, so the bos is the
        template's own, never a second one) or the text (tokenize=False).
        """
        template, source = chat.choose_template(self.chat_templates, chat_template, tools=tools,
                                                home=self.template_home)
        text = chat.render_chat_template(template, conversation,
                                         add_generation_prompt=add_generation_prompt,
                                         special_tokens=self.special_tokens, tools=tools,
                                         documents=documents, source=source,
                                         limits=self.chat_template_limits, **kwargs)
        return self._encode_rendered(text) if tokenize else text


class CharTokenizer(_TokenizerMixin):
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


_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")


def _token_content(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class _SideFiles:
    """What a checkpoint directory says about its tokenizer besides the vocabulary:
    tokenizer_config.json and special_tokens_map.json (the config wins)."""

    def __init__(self, directory: pathlib.Path):
        self.config: dict[str, Any] | None = None
        self.names: dict[str, str | None] = {}      # "eos_token" -> "<|im_end|>" (None: null)
        self.sources: dict[str, pathlib.Path] = {}  # "eos_token" -> the file that said so
        for side in ("special_tokens_map.json", "tokenizer_config.json"):
            side_path = directory / side
            if side_path.is_file():
                cfg = read_json_object(side_path)
                if side == "tokenizer_config.json":
                    self.config = cfg
                for key in _SPECIAL_TOKEN_KEYS:
                    if key in cfg:
                        self.names[key] = _token_content(cfg[key])
                        self.sources[key] = side_path

    def add_bos_token(self) -> bool | None:
        """tokenizer_config.json's "add_bos_token", None when it does not say."""
        value = (self.config or {}).get("add_bos_token")
        return value if isinstance(value, bool) else None


class SentencePieceTokenizer(_TokenizerMixin):
    """A sentencepiece `.model` file. Ids come from the model; `eos_id`/`pad_id` override them.

    Models without a pad piece (Llama-2, Mistral) pad with unk, which a trained model almost never
    emits, so pad differs from eos and `decode` can tell a finished row from padding; with neither,
    pad falls back to eos. A tokenizer_config.json beside the file (a HF checkpoint) gives the
    prompt BOS rule (add_bos_token; without one, prompts get no bos) and the chat template;
    generation_config.json gives more stop ids.
    """

    def __init__(self, model_file: str | pathlib.Path, *, eos_id: int | None = None,
                 pad_id: int | None = None, add_bos_token: bool | None = None):
        import sentencepiece as spm

        path = pathlib.Path(model_file)
        if not path.is_file():
            raise FileNotFoundError(f"sentencepiece model file not found: {path}")
        self.model_file = path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as e:  # "could not parse ModelProto"
            raise ValueError(f"{path}: not a readable sentencepiece model ({e})") from None
        self.vocab_size = int(self._sp.vocab_size())
        bos = self._sp.bos_id()
        self.bos_id = bos if bos >= 0 else None
        eos = self._sp.eos_id() if eos_id is None else eos_id
        if eos < 0:
            raise ValueError(f"{path} defines no eos piece; pass eos_id=")
        self.eos_id = int(eos)
        if pad_id is None:
            pad_id = next((i for i in (self._sp.pad_id(), self._sp.unk_id()) if i >= 0), self.eos_id)
        self.pad_id = int(pad_id)
        for name, value in (("eos_id", self.eos_id), ("pad_id", self.pad_id)):
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value} is outside {path}'s vocabulary 0..{self.vocab_size - 1}")
        side = _SideFiles(path.parent) if (path.parent / "tokenizer_config.json").is_file() else None
        self.eos_ids = _unique([self.eos_id, *stop_ids_beside(path.parent, self.vocab_size)]
                               if side is not None else [self.eos_id])
        if add_bos_token is None:
            add_bos_token = bool(side and side.add_bos_token())
        self.add_bos_token = add_bos_token and self.bos_id is not None
        pieces = {"bos_token": self.bos_id, "eos_token": self.eos_id, "unk_token": self._sp.unk_id(),
                  "pad_token": self._sp.pad_id()}
        self.special_tokens = {k: self._sp.id_to_piece(i) for k, i in pieces.items()
                               if i is not None and i >= 0}
        if side is not None:
            self.special_tokens.update({k: v for k, v in side.names.items() if v is not None})
        self.template_home = str(path.parent)
        self.chat_templates = chat.read_chat_templates(path.parent, side.config if side else None)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(self._sp.encode(text, out_type=int))
        if add_bos:
            if self.bos_id is None:
                raise ValueError(f"{self.model_file} defines no bos piece; call encode with add_bos=False")
            ids.insert(0, self.bos_id)
        return ids

    @cached_property
    def _control_pieces(self) -> tuple[dict[str, int], re.Pattern | None]:
        """Control and unknown pieces (<s>, </s>, <unk>, ...) by text, and a pattern finding them:
        sentencepiece never matches them in text, a template spells them out."""
        found = {self._sp.id_to_piece(i): i for i in range(self.vocab_size)
                 if self._sp.is_control(i) or self._sp.is_unknown(i)}
        found = {piece: i for piece, i in found.items() if piece}
        if not found:
            return found, None
        return found, re.compile("|".join(re.escape(p) for p in sorted(found, key=len, reverse=True)))

    def _encode_rendered(self, text: str) -> list[int]:
        """Template text with special tokens spelled out ("<s>[INST] ..."): each special token is
        its id, and each run of text between them is encoded on its own."""
        by_text, pattern = self._control_pieces
        if pattern is None:
            return self.encode(text)
        ids: list[int] = []
        start = 0
        for m in pattern.finditer(text):
            if m.start() > start:
                ids += self.encode(text[start:m.start()])
            ids.append(by_text[m.group()])
            start = m.end()
        if start < len(text):
            ids += self.encode(text[start:])
        return ids

    def decode(self, ids) -> str:
        drop = () if self.bos_id is None else (self.bos_id,)
        return self._sp.decode(completion_ids(ids, self.eos_ids, self.pad_id, drop, self.vocab_size))

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({str(self.model_file)!r})"


class HFTokenizer(_TokenizerMixin):
    """A Hugging Face `tokenizer.json` (Qwen, Llama-3) through the `tokenizers` package.

    bos/eos/pad tokens come from the arguments if given, else from `tokenizer_config.json` or
    `special_tokens_map.json` beside the file. No pad token (Llama-3) means pad = eos. Stop ids:
    eos first, then generation_config.json's "eos_token_id" (an int or a list).
    `encode` never adds the post-processor's special tokens; `add_bos` is the only way a bos gets
    in. Prompts (`encode_prompt`) get one as transformers would add it: tokenizer_config.json's
    "add_bos_token" when it says, else whether tokenizer.json's post-processor prepends bos
    (Llama-3's does, Qwen's adds nothing).
    """

    def __init__(self, tokenizer_json: str | pathlib.Path, *, eos_id: int | None = None,
                 pad_id: int | None = None, bos_id: int | None = None,
                 add_bos_token: bool | None = None):
        from tokenizers import Tokenizer as _HFTok

        path = pathlib.Path(tokenizer_json)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer.json not found: {path}")
        self.tokenizer_json = path
        try:
            self._tok = _HFTok.from_file(str(path))
        except Exception as e:  # noqa: BLE001 -- tokenizers raises plain Exception ("EOF while parsing")
            raise ValueError(f"{path}: not a readable tokenizer.json ({e})") from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        side = _SideFiles(path.parent)

        def id_of(key: str) -> int | None:
            name = side.names.get(key)
            if name is None:
                return None
            tid = self._tok.token_to_id(name)
            if tid is None:
                raise ValueError(f"{key} {name!r} from {side.sources[key]} is not in the vocabulary of {path}")
            return int(tid)

        self.bos_id = bos_id if bos_id is not None else id_of("bos_token")
        stops = stop_ids_beside(path.parent, self.vocab_size)
        eos = eos_id if eos_id is not None else id_of("eos_token")
        if eos is None and stops:
            eos = stops[0]
        if eos is None:
            raise ValueError(f"no eos token for {path}: put tokenizer_config.json (eos_token) or "
                             "generation_config.json (eos_token_id) beside it or pass eos_id=")
        self.eos_id = int(eos)
        self.eos_ids = _unique([self.eos_id, *stops])
        pad = pad_id if pad_id is not None else id_of("pad_token")
        self.pad_id = self.eos_id if pad is None else int(pad)
        if add_bos_token is None:
            add_bos_token = side.add_bos_token()
        if add_bos_token is None:  # transformers keeps tokenizer.json's post-processor then
            probe = self._tok.encode("", add_special_tokens=True).ids
            add_bos_token = bool(probe) and probe[0] == self.bos_id
        self.add_bos_token = add_bos_token and self.bos_id is not None
        self.special_tokens = {k: v for k, v in side.names.items() if v is not None}
        self.template_home = str(path.parent)
        self.chat_templates = chat.read_chat_templates(path.parent, side.config)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_bos:
            if self.bos_id is None:
                raise ValueError(f"{self.tokenizer_json} has no bos token; call encode with "
                                 "add_bos=False or pass bos_id=")
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids) -> str:
        drop = () if self.bos_id is None else (self.bos_id,)
        return self._tok.decode(completion_ids(ids, self.eos_ids, self.pad_id, drop, self.vocab_size),
                                skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.tokenizer_json)!r})"


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
