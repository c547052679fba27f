"""A model's text codec: its own tokenizer (transformers' `AutoTokenizer`, read from beside the checkpoint or
from `--tokenizer`), or the byte codec of byte-level models (vocabulary 256, UTF-8 bytes as ids).

Every stage that turns text into ids, or ids into text, asks `tokenizer_of(program)`, so a subword model never
reads bytes as ids: a model whose vocabulary is not the byte vocabulary and that has no tokenizer is refused."""
from __future__ import annotations

import hashlib
import json
import re
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..ir.companions import has_tokenizer

BYTE_VOCAB = 256


class TokenizerError(UsageError):
    """No tokenizer for a model, one that does not fit it, or two models that do not share one."""


class TemplateError(TokenizerError):
    """The tokenizer's chat template cannot render a conversation (a role it refuses, a broken template)."""


#: how documents and prompts get BOS and EOS (HFTokenizer.document, _bos_for): part of every tokenizer's identity
JOIN_RULE = "bos-unless-present+text+eos/1"


def plain_chat(messages: list[dict], generation_prompt: bool = False) -> str:
    """A conversation as role-tagged plain text, for a tokenizer without a chat template (as Model Optimizer's
    data tools render it)."""
    text = "".join(f"{m['role']}: {m['content']}\n\n" for m in messages)
    return text + ("assistant: " if generation_prompt else "")


class ByteCodec:
    """UTF-8 bytes as token ids: the built-in model's codec. Documents are joined by a blank line (no EOS)."""

    name = "bytes"
    identity = vocab_hash = "utf-8 bytes"
    vocab_size = BYTE_VOCAB
    eos_id = bos_id = None
    directory = None
    separator = np.frombuffer(b"\n\n", dtype=np.uint8)

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="surrogateescape"), dtype=np.uint8)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def document(self, ids, text: str) -> np.ndarray:
        """A document as it is joined: its bytes, then a blank line."""
        return np.concatenate([ids, self.separator])

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def prompt(self, text: str) -> np.ndarray:
        return self.encode(text).astype(np.int64)

    def render_chat(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return plain_chat(messages, generation_prompt)

    @cached_property
    def token_bytes(self) -> np.ndarray:
        return np.ones(BYTE_VOCAB, dtype=np.int64)


BYTES = ByteCodec()


def _byte_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): one printable character per byte value, so a token's string
    spells its bytes one character each."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class HFTokenizer:
    """A transformers tokenizer with what the data layer needs: batched encoding, EOS/BOS for joining
    documents, the chat template, a per-id byte length (bits per byte) and fingerprints."""

    def __init__(self, path: Path):
        from transformers import AutoTokenizer

        self.directory = Path(path)
        try:
            # no remote code: a child's config names its model code (auto_map), which a tokenizer never needs, and
            # transformers would otherwise print a prompt about it on stdout
            self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        except Exception as e:  # transformers raises OSError, ValueError, ... for what it cannot read
            raise TokenizerError(f"cannot read a tokenizer from {path} ({type(e).__name__}: {str(e).splitlines()[0]}); "
                                 "pass --tokenizer with the directory holding the model's tokenizer files") from None
        self.name = str(path)
        self.vocab_size = len(self.tok)
        self.eos_id = self.tok.eos_token_id
        self.bos_id = self.tok.bos_token_id if self._adds_bos() else None

    def _adds_bos(self) -> bool:
        bos = self.tok.bos_token_id
        return bos is not None and self.tok("a", add_special_tokens=True)["input_ids"][:1] == [bos]

    @cached_property
    def _backend_spec(self) -> str | None:
        """The fast tokenizer's whole definition as JSON (None for a slow one): serialised once (MBs at 131k)."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        return backend.to_str() if backend is not None else None

    @cached_property
    def identity(self) -> str:
        """What decides the ids a text gets (the cache key of tokenized data)."""
        spec = self._backend_spec or json.dumps(sorted(self.tok.get_vocab().items()))
        template = json.dumps(getattr(self.tok, "chat_template", None), sort_keys=True)
        return hashlib.sha256(f"{spec}|{self.bos_id}|{self.eos_id}|{template}|{JOIN_RULE}".encode()).hexdigest()

    @cached_property
    def vocab_hash(self) -> str:
        """What decides what an id means: two models compared token by token (KL, agreement) must share it."""
        return hashlib.sha256(json.dumps(sorted(self.tok.get_vocab().items())).encode()).hexdigest()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        clean = [t.encode("utf-8", errors="replace").decode("utf-8") for t in texts]  # lone surrogates
        return self.tok(clean, add_special_tokens=False)["input_ids"]

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.encode_batch([text])[0], dtype=np.int64)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def _bos_for(self, text: str) -> list[int]:
        """The BOS the tokenizer adds, unless the text (a rendered chat) already starts with it."""
        return [self.bos_id] if self.bos_id is not None and not text.startswith(self.tok.bos_token) else []

    def prompt(self, text: str) -> np.ndarray:
        """A prompt's ids as transformers' tokenizer call gives them: BOS (see _bos_for), the text, no EOS."""
        return np.asarray(self._bos_for(text) + self.encode_batch([text])[0], dtype=np.int64)

    def render_chat(self, messages: list[dict], generation_prompt: bool = False) -> str:
        if not getattr(self.tok, "chat_template", None):
            return plain_chat(messages, generation_prompt)
        try:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja2's TemplateError (raise_exception, a syntax error), a TypeError in it, ...
            first = (str(e).splitlines() or [""])[0][:200]
            raise TemplateError(f"the chat template of {self.name} cannot render it ({type(e).__name__}: {first})") \
                from None

    def document(self, ids: list[int], text: str) -> list[int]:
        """A document's ids as it is joined: the BOS the tokenizer adds (unless the text already starts with
        it, as a chat template's does), then the text, then EOS."""
        return self._bos_for(text) + list(ids) + ([self.eos_id] if self.eos_id is not None else [])

    @cached_property
    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes each id stands for in running text (special tokens 0), so that summed NLL over a window's
        tokens divided by their bytes is bits per byte. Exact for byte-level BPE and byte-fallback pieces; a
        SentencePiece word piece counts its leading space, which the first word of a document does not have."""
        tokens = self.tok.convert_ids_to_tokens(list(range(self.vocab_size)))
        special = set(self.tok.all_special_ids)
        added = {i for i, t in getattr(self.tok, "added_tokens_decoder", {}).items() if not t.special} - special
        decoder = (json.loads(self._backend_spec).get("decoder") or {}) if self._backend_spec else {}
        byte_level = "ByteLevel" in json.dumps(decoder)
        alphabet = _byte_alphabet()
        out = np.zeros(self.vocab_size, dtype=np.int64)
        for i, t in enumerate(tokens):
            if t is None or i in special:
                continue
            if i in added:
                out[i] = len(t.encode())
            elif byte_level and all(c in alphabet for c in t):
                out[i] = len(t)
            elif _BYTE_TOKEN.fullmatch(t):
                out[i] = 1
            else:
                out[i] = len(t.replace("\u2581", " ").encode())
        return out


_LOADED: dict[str, HFTokenizer] = {}


def load_tokenizer(path) -> HFTokenizer:
    """The tokenizer in a directory (or a hub id, through the local hub cache), read once per process."""
    from .hub import resolve

    local = resolve(str(path), "tokenizer")
    key = str(local.resolve())
    if local.is_dir():  # an edited file (a chat template) is read anew
        key += "".join(f"|{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(local.iterdir())
                       if f.is_file() and not f.name.endswith(".safetensors"))
    if key not in _LOADED:
        if not local.is_dir() or not has_tokenizer(local):
            raise TokenizerError(f"{path} holds no tokenizer (tokenizer.json, tokenizer_config.json or "
                                 "tokenizer.model); pass --tokenizer with the directory of the model's tokenizer files")
        _LOADED[key] = HFTokenizer(local)
    return _LOADED[key]


def vocab_of(prog) -> int:
    emb = prog.find("embed")
    return emb[0].op.vocab if emb else BYTE_VOCAB


def tokenizer_of(prog):
    """The program's codec: the tokenizer it names (`meta["tokenizer"]`: found beside its checkpoint, or set by
    --tokenizer), else the byte codec when its vocabulary is the byte vocabulary; refused otherwise, and when
    the tokenizer's ids do not fit the model's vocabulary."""
    vocab = vocab_of(prog)
    path = prog.meta.get("tokenizer")
    if not path:
        if vocab == BYTE_VOCAB:
            return BYTES
        where = prog.meta.get("source") or "the model"
        raise TokenizerError(f"{where} has a {vocab:,}-token vocabulary, not bytes, and no tokenizer beside it: pass "
                             "--tokenizer PATH (the directory of the model's tokenizer files, or its hub id)")
    tok = load_tokenizer(path)
    if tok.vocab_size > vocab:
        raise TokenizerError(f"the tokenizer {tok.name} has {tok.vocab_size:,} ids but the model's vocabulary is "
                             f"{vocab:,}: its ids do not fit; pass the model's own tokenizer with --tokenizer")
    return tok


def set_tokenizer(prog, path) -> None:
    """Makes `path` the program's tokenizer (--tokenizer), checked against its vocabulary now, before any work."""
    if path:
        prog.meta["tokenizer"] = str(load_tokenizer(path).directory.resolve())
        tokenizer_of(prog)


def check_shared(student, teacher, what: str = "the teacher") -> None:
    """Two programs compared token by token must give ids the same meaning: refuse different tokenizers."""
    a, b = tokenizer_of(student), tokenizer_of(teacher)
    if a.vocab_hash != b.vocab_hash:
        raise TokenizerError(f"the model's tokenizer ({a.name}) and {what}'s ({b.name}) differ: their token ids mean "
                             "different text, so KL and agreement would compare unrelated tokens; use models that "
                             "share a tokenizer (or give both the same one with --tokenizer)")

