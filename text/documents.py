"""Documents from the formats the field keeps text in: text files and directories, JSONL, Parquet, `datasets`
directories written by `save_to_disk`, and hub datasets.

A record becomes one document by the first of its fields that is present, in Model Optimizer's order: chat
`messages` / `conversations` (rendered by the tokenizer's chat template), `prompt` + `completion` (or
`response`, `output`), `text`, `input` + `output`. Every document has a stable name (its file, and its line or
row), which decides the held-out split, so the split does not depend on how a path was spelled.

A `.json` file is JSON: an array of records, one record, or records one per line (as JSONL). What is not text is
refused rather than read as if it were: a FIFO, device or socket (never opened, so nothing blocks), and a binary
file (model weights, an archive: anything with NUL bytes)."""
from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import UsageError

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".jsonl", ".c", ".h", ".toml", ".cfg", ".ini", ".html",
                 ".parquet"}
#: files that mark a directory written by `datasets`' save_to_disk
DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
#: ShareGPT's speaker names, as chat templates know them
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}

#: bump when the documents a file yields change (fields read, how records are named): part of the cache key
FORMAT = 2
#: bytes looked at to tell a binary file from text
SNIFF_BYTES = 1 << 16
#: what a binary file's first bytes say it is
MAGIC = ((b"PK\x03\x04", "a zip archive"), (b"\x1f\x8b", "a gzip archive"), (b"PAR1", "a Parquet file without "
         "the .parquet suffix"), (b"\x89HDF", "an HDF5 file"), (b"\x7fELF", "a program"))

Chat = Callable[[list[dict]], str]


class DataError(UsageError):
    """Training or evaluation data cannot be read or is not enough for what was asked (exit code 2)."""


def _messages(turns, where: str) -> list[dict]:
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise DataError(f"{where}: chat messages must be a list of {{\"role\": ..., \"content\": ...}} objects")
    out = []
    for t in turns:
        role, content = t.get("role", t.get("from")), t.get("content", t.get("value"))
        if not isinstance(role, str) or not isinstance(content, str):
            raise DataError(f"{where}: each chat message needs a string \"role\" and \"content\" (or ShareGPT's "
                            "\"from\" and \"value\")")
        out.append({"role": ROLES.get(role, role), "content": content})
    return out


def record_text(rec, where: str, chat: Chat) -> str:
    """The document a record holds (see the module's docstring for the fields read, in order)."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: each record must be an object with a text, messages or prompt field")
    from ..errors import PuzzlekitError

    for key in ("messages", "conversations"):
        if rec.get(key) is not None:
            try:
                return chat(_messages(rec[key], where))
            except DataError:
                raise
            except PuzzlekitError as e:  # the chat template refuses it: name the record
                raise DataError(f"{where}: {e}") from None
    for first, seconds in (("prompt", ("completion", "response", "output")), ("text", ()), ("input", ("output",))):
        if rec.get(first) is None:
            continue
        parts = [rec[first]] + [rec[s] for s in seconds if rec.get(s) is not None][:1]
        if not all(isinstance(p, str) for p in parts):
            raise DataError(f"{where}: the field \"{first}\" (and its pair) must be strings")
        return "".join(parts)
    raise DataError(f"{where}: a record needs a string field \"text\", chat \"messages\", or \"prompt\" and "
                    f"\"completion\" (it has {', '.join(sorted(rec)) or 'no fields'})")


def _utf8(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start})") from None


def _json(path: Path, name: str, chat: Chat) -> Iterator[tuple[str, str]]:
    """A JSON array of records (named by row), a single record, or records one per line (JSONL)."""
    text = _utf8(path)
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg != "Extra data":  # more than one value: JSON Lines
            raise DataError(f"{path}: not valid JSON ({e.msg}, line {e.lineno} column {e.colno})") from None
        yield from _jsonl(path, name, chat)
        return
    if isinstance(whole, list):
        yield from _rows(whole, name, str(path), chat)
    elif isinstance(whole, dict):
        yield name, record_text(whole, str(path), chat)
    else:
        raise DataError(f"{path}: a JSON data file holds an array of records or one record (an object), not a "
                        f"{type(whole).__name__}")


def _jsonl(path: Path, name: str, chat: Chat) -> Iterator[tuple[str, str]]:
    text = _utf8(path)
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{i + 1}: not valid JSON ({e.msg})") from None
        yield f"{name}:{i + 1}", record_text(rec, f"{path}:{i + 1}", chat)


def _rows(rows, name: str, where: str, chat: Chat) -> Iterator[tuple[str, str]]:
    for i, rec in enumerate(rows):
        yield f"{name}:{i + 1}", record_text(rec, f"{where} row {i + 1}", chat)


def _parquet(path: Path, name: str, chat: Chat) -> Iterator[tuple[str, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install 'puzzlekit[data]'") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    yield from _rows(table.to_pylist(), name, str(path), chat)


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DataError("reading a datasets directory or a hub dataset needs the datasets library: "
                        "pip install 'puzzlekit[data]'") from None
    return datasets


def _dataset_rows(ds, split: str | None, where: str):
    datasets = _datasets()
    if isinstance(ds, datasets.DatasetDict):
        split = split or ("train" if "train" in ds else next(iter(ds)))
        if split not in ds:
            raise DataError(f"{where} has no split {split!r} (it has {', '.join(ds)})")
        ds = ds[split]
    return ds


def _saved(path: Path, name: str, chat: Chat) -> Iterator[tuple[str, str]]:
    try:
        ds = _datasets().load_from_disk(str(path))
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{path}: not a dataset written by save_to_disk ({type(e).__name__}: {e})") from None
    yield from _rows(_dataset_rows(ds, None, str(path)), name, str(path), chat)


def _hub(spec: str, chat: Chat) -> Iterator[tuple[str, str]]:
    """NAME, NAME:SPLIT or NAME:CONFIG:SPLIT, from the local datasets cache or, online, the hub."""
    from .hub import online

    datasets = _datasets()
    parts = spec.split(":")
    name, config, split = parts[0], (parts[1] if len(parts) == 3 else None), (parts[-1] if len(parts) > 1 else None)
    offline = not online()
    before = datasets.config.HF_HUB_OFFLINE
    try:
        datasets.config.HF_HUB_OFFLINE = offline or before
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:
        if offline:
            raise DataError(f"{spec} is neither a file nor a directory here, and as a hub dataset it is not cached and "
                            "the hub cannot be reached (offline); save it on a connected machine "
                            "(datasets' save_to_disk) and pass that directory") from None
        raise DataError(f"cannot load the hub dataset {spec} ({type(e).__name__}: {e})") from None
    finally:
        datasets.config.HF_HUB_OFFLINE = before
    yield from _rows(_dataset_rows(ds, split, spec), spec, spec, chat)


def read_documents(source, chat: Chat, name: str | None = None) -> Iterator[tuple[str, str]]:
    """(name, text) of every document in one --data argument. Text files are read as UTF-8 with undecodable
    bytes kept (surrogate escapes), so a byte-level model reads exactly the file's bytes."""
    from .hub import is_hub_id

    path = Path(source)
    name = name or path.name
    if not path.exists():
        if is_hub_id(str(source).split(":")[0]):
            yield from _hub(str(source), chat)
            return
        raise DataError(f"{path} does not exist; pass text files, directories, .jsonl or .parquet files, a datasets "
                        "directory (save_to_disk) or a hub dataset name")
    check_regular(path)
    if path.is_dir() and any((path / m).exists() for m in DATASET_MARKERS):
        yield from _saved(path, name, chat)
    elif path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES):
            yield from read_documents(f, chat, f.relative_to(path).as_posix())
    elif path.suffix == ".jsonl":
        yield from _jsonl(path, name, chat)
    elif path.suffix == ".json":
        yield from _json(path, name, chat)
    elif path.suffix == ".parquet":
        yield from _parquet(path, name, chat)
    else:
        data = path.read_bytes()
        refuse_binary(path, data[:SNIFF_BYTES])
        yield name, data.decode("utf-8", errors="surrogateescape")


def check_regular(path: Path, what: str = "data") -> None:
    """Refuses a path that is neither a regular file nor a directory (a FIFO, a device, a socket), from its
    status alone: opening a FIFO would wait for a writer forever."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise DataError(f"cannot read the {what} {path} ({e.strerror})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else \
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"
        raise DataError(f"the {what} {path} is {kind}, not a file or a directory: puzzlekit reads {what} from files "
                        "(write the stream to a file first)")


def refuse_binary(path: Path, head: bytes) -> None:
    """Refuses a file whose first bytes are not text: model weights, archives, programs."""
    if b"\0" not in head:
        return
    kind = next((k for magic, k in MAGIC if head.startswith(magic)), None)
    if kind is None and (path.suffix == ".safetensors" or head[8:9] == b"{"):
        kind = "model weights (safetensors)"
    raise DataError(f"{path} is {kind or 'a binary file'}, not text; pass text files, .jsonl, .json or .parquet "
                    "records, or a datasets directory as --data")


def fingerprint(sources: list[str]) -> str:
    """A content hash of the --data arguments (every file's bytes under its name; a hub dataset by its name):
    the key of tokenized data."""
    h = hashlib.sha256()
    for source in sources:
        path = Path(source)
        h.update(f"\0{source}\0".encode())
        if not path.exists():  # a hub dataset: keyed by its name (a new revision needs a new tokenization)
            continue
        check_regular(path)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            h.update(f"\0{f.relative_to(path) if path.is_dir() else f.name}\0{_file_digest(f)}".encode())
    return h.hexdigest()


_DIGESTS: dict[tuple, str] = {}


def _file_digest(f: Path) -> str:
    """A file's sha256, read once per process while its size and modification time stay the same (every stage
    of a run asks for the data's fingerprint; a corpus of many GB is hashed once)."""
    st = f.stat()
    key = (str(f.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]

