"""Text <-> token ids behind one small interface: characters, sentencepiece, or HF tokenizer.json.

The trainer only sees `Tokenizer`: `encode`, `decode` (skips pad, stops at the first eos) and
`batch_encode` (left-padded, because the sampler appends new tokens on the right of every row).

    load_tokenizer("char:0123456789+=")      # the CPU demo: one id per character, + eos + pad
    load_tokenizer("builtin")                # the shipped sentencepiece model for built-in tasks
    load_tokenizer("/ckpt/tokenizer.model")  # any sentencepiece model (Llama-2, Gemma, Mistral)
    load_tokenizer("/ckpt")                  # a directory with tokenizer.json (Qwen, Llama-3) or .model
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

import numpy as np

BUILTIN_SPM_PATH = pathlib.Path(__file__).parent / "assets" / "task_spm.model"
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
    pad_id: int

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...

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


def completion_ids(ids: Iterable[int], eos_id: int, pad_id: int,
                   drop: tuple[int, ...] = (), vocab_size: int | None = None) -> list[int]:
    """The ids `decode` turns into text: leading pads dropped, cut before the first eos, other
    pads (and ids in `drop`) removed, and ids >= `vocab_size` removed: a model's embedding table
    is often padded past its tokenizer (Qwen2.5: 151,936 rows for 151,665 tokens), and a sampled
    padding row has no text, so it decodes to nothing rather than crashing the run.

    Leading pads go first so that a left-padded row still decodes when pad == eos (HF models
    without a pad token reuse eos).
    """
    arr = np.asarray(ids)
    if arr.ndim > 1:
        raise ValueError(f"decode takes one row of ids, got an array of shape {arr.shape}")
    flat = [int(i) for i in arr.reshape(-1)]
    start = 0
    while start < len(flat) and flat[start] == pad_id:
        start += 1
    out = []
    for i in flat[start:]:
        if i == eos_id:
            break
        if i != pad_id and i not in drop and (vocab_size is None or 0 <= i < vocab_size):
            out.append(i)
    return out


class _BatchEncodeMixin:
    pad_id: int

    def batch_encode(self, texts: Sequence[str], *, max_len: int | None = None,
                     add_bos: bool = False, truncate: bool = False
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Encodes `texts` into left-padded `ids_BxL` (int32) and `mask_BxL` (bool)."""
        if isinstance(texts, str):
            raise TypeError("batch_encode takes a list of strings, got one str; wrap it in a list")
        rows = [self.encode(t, add_bos=add_bos) for t in texts]  # type: ignore[attr-defined]
        return left_pad(rows, self.pad_id, max_len, truncate)


class CharTokenizer(_BatchEncodeMixin):
    """One id per character of `symbols` (in order), then eos, then pad; no bos.

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
        self.pad_id = len(symbols) + 1
        self.bos_id = None
        self.vocab_size = len(symbols) + 2

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        if add_bos:
            raise ValueError("CharTokenizer has no bos token; call encode with add_bos=False")
        try:
            return [self._id_of[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} in {text!r} is not one of the "
                             f"CharTokenizer symbols {self.symbols!r}") from None

    def decode(self, ids) -> str:
        out = completion_ids(ids, self.eos_id, self.pad_id, vocab_size=len(self.symbols))
        return "".join(self.symbols[i] for i in out)

    def __repr__(self) -> str:
        return f"CharTokenizer({self.symbols!r})"


class SentencePieceTokenizer(_BatchEncodeMixin):
    """A sentencepiece `.model` file. Ids come from the model; `eos_id`/`pad_id` override them.

    Models without a pad piece (Llama-2, Mistral) pad with unk, which a trained model almost never
    emits, so pad differs from eos and `decode` can tell a finished row from padding; with neither,
    pad falls back to eos.
    """

    def __init__(self, model_file: str | pathlib.Path, *, eos_id: int | None = None,
                 pad_id: int | None = None):
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

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(self._sp.encode(text, out_type=int))
        if add_bos:
            if self.bos_id is None:
                raise ValueError(f"{self.model_file} defines no bos piece; call encode with add_bos=False")
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids) -> str:
        drop = () if self.bos_id is None else (self.bos_id,)
        return self._sp.decode(completion_ids(ids, self.eos_id, self.pad_id, drop, self.vocab_size))

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({str(self.model_file)!r})"


def _token_content(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer(_BatchEncodeMixin):
    """A Hugging Face `tokenizer.json` (Qwen, Llama-3) through the `tokenizers` package.

    bos/eos/pad tokens come from the arguments if given, else from `tokenizer_config.json` or
    `special_tokens_map.json` beside the file. No pad token (Llama-3) means pad = eos.
    `encode` never adds the post-processor's special tokens; `add_bos` is the only way a bos gets in.
    """

    def __init__(self, tokenizer_json: str | pathlib.Path, *, eos_id: int | None = None,
                 pad_id: int | None = None, bos_id: int | None = None):
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
        names: dict[str, str | None] = {}
        sources: dict[str, pathlib.Path] = {}
        for side in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
            side_path = path.with_name(side)
            if side_path.is_file():
                cfg = read_json_object(side_path)
                for key in ("bos_token", "eos_token", "pad_token"):
                    if key in cfg:
                        names[key] = _token_content(cfg[key])
                        sources[key] = side_path

        def id_of(key: str) -> int | None:
            name = names.get(key)
            if name is None:
                return None
            tid = self._tok.token_to_id(name)
            if tid is None:
                raise ValueError(f"{key} {name!r} from {sources[key]} is not in the vocabulary of {path}")
            return int(tid)

        self.bos_id = bos_id if bos_id is not None else id_of("bos_token")
        eos = eos_id if eos_id is not None else id_of("eos_token")
        if eos is None:
            raise ValueError(f"no eos token for {path}: put tokenizer_config.json (eos_token) beside "
                             "it or pass eos_id=")
        self.eos_id = int(eos)
        pad = pad_id if pad_id is not None else id_of("pad_token")
        self.pad_id = self.eos_id if pad is None else int(pad)

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
        return self._tok.decode(completion_ids(ids, self.eos_id, self.pad_id, drop, self.vocab_size),
                                skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.tokenizer_json)!r})"


def load_tokenizer(spec: str) -> Tokenizer:
    """Builds a tokenizer from a spec string; see the module docstring for the accepted forms."""
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
        raise FileNotFoundError(f"directory {path} holds neither tokenizer.json nor a "
                                "sentencepiece .model file")
    if path.suffix == ".model":
        return SentencePieceTokenizer(path)
    if path.suffix == ".json":
        return HFTokenizer(path)
    if path.exists():
        raise ValueError(f"tokenizer file {path} is neither a .model nor a .json file; accepted: {_SPEC_HELP}")
    raise ValueError(f"unknown tokenizer spec {spec!r}; accepted: {_SPEC_HELP}")
