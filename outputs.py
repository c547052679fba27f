"""One output policy for every command that writes a directory or a file.

- An output may not be an input, hold an input (a parent of one) or sit inside an input directory. The inputs
  are the ones a writer names (a program's checkpoint) and every path the command was given to read
  (`declared_inputs`: --data, --tokenizer, --teacher, --library, --cost-table, --include-path, task data, ...),
  so no writer anywhere can replace a file the user owns.
- It is checked before the work starts: an existing output needs `overwrite`, the path may not lie below
  a regular file, and its directory must be writable and have room (a probe directory is created).
- It is written into a hidden staging directory beside it and put in place in one step. On Linux the
  staged and the old directory are exchanged atomically (renameat2 RENAME_EXCHANGE), so a kill at any
  moment leaves the old or the new output in place, never neither; elsewhere two renames are used and
  the next write restores the old output if a kill fell between them.
- Staging directories left by a killed run are removed by the next write beside them.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import PuzzlekitError, UsageError

STAGING = ".puzzlekit-staging"  # infix of staging directory names: .{name}{STAGING}.{pid}.{random}


class OutputError(PuzzlekitError):
    """An output path would destroy an input, cannot be written, or exists without overwrite."""


def _existing_ancestor(path: Path) -> Path:
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            return p
    return Path("/")


#: the running command's input paths and the option that named each (declared_inputs)
_DECLARED: list[tuple[Path, str]] = []


@contextmanager
def declared_inputs(named: Iterable[tuple[str, str]]) -> Iterator[None]:
    """For the block's duration, every (path, option) pair is an input no output may touch (check_inputs, and
    so check_output and staged_dir everywhere). Paths that do not exist are skipped (a hub id, a dataset name:
    nothing on disk to lose); one that is neither a file nor a directory is refused now, from its status alone
    (a FIFO is never opened)."""
    before = list(_DECLARED)
    try:
        declare(named)
        yield
    finally:
        _DECLARED[:] = before


def declare(named: Iterable[tuple[str, str]]) -> None:
    """Adds inputs to the running command's (see declared_inputs): task data found once the tasks load."""
    for path, option in named:
        p = Path(path)
        try:
            mode = os.stat(p).st_mode
        except OSError:
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise UsageError(f"{option} {path} is not a regular file or a directory (a FIFO, device or socket); "
                             "puzzlekit reads its inputs from files: write the stream to a file first")
        _DECLARED.append((p.resolve(), option))


def check_inputs(out, inputs: Iterable = (), own: Iterable = ()) -> Path:
    """Refuses an output (a directory or a file) that equals, contains or lies inside an input: one of `inputs`
    or of the command's declared ones, except the paths in `own` (files of a run that the run itself wrote and
    reads back, such as a compress run's cost table)."""
    out = Path(out).resolve()
    mine = {Path(p).resolve() for p in own}
    for src, option in [(Path(p).resolve(), "") for p in inputs] + list(_DECLARED):
        if src in mine:
            continue
        named = f"the input {src}" + (f" ({option})" if option else "")
        if out == src or src.is_relative_to(out):
            raise OutputError(f"output {out} would replace {named}; choose another output")
        if src.is_dir() and out.is_relative_to(src):
            raise OutputError(f"output {out} lies inside {named}; choose an output outside it")
    return out


def check_output(out, inputs: Iterable = (), overwrite: bool = False, need_bytes: int = 0) -> Path:
    """Refuses an output that would eat an input or cannot be written; returns its resolved path.

    What a killed earlier write left beside `out` is cleaned up first, so the checks see the real state."""
    out = Path(out).resolve()
    if out.parent.is_dir():
        clean_stale(out)
    check_inputs(out, inputs)
    if out.exists() and not out.is_dir():
        raise OutputError(f"output {out} is a file; the output must be a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputError(f"output {out} exists and is not empty; pass --overwrite to replace it, or choose another "
                          "directory")
    base = _existing_ancestor(out.parent)
    if not base.is_dir():
        raise OutputError(f"output {out} lies below {base}, which is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".puzzlekit-probe.", dir=base))
    except OSError as e:
        raise OutputError(f"cannot write in {base} ({e.strerror}); choose a writable output directory") from None
    free = shutil.disk_usage(base).free
    if need_bytes > free:
        raise OutputError(f"output {out} needs about {need_bytes / 1e6:,.1f} MB but {base} has "
                          f"{free / 1e6:,.1f} MB free; free some space or choose another disk")
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(out: Path) -> None:
    """Removes staging directories of `out` whose process is gone; restores an old output that a kill
    between the two renames of the fallback left only in staging."""
    for p in sorted(out.parent.glob(f".{out.name}{STAGING}.*")):
        try:
            pid = int(p.name.rsplit(".", 2)[-2])
        except ValueError:
            continue
        if pid == os.getpid() or _alive(pid):
            continue
        old = p / "old"
        if old.is_dir() and not out.exists():
            os.replace(old, out)
        shutil.rmtree(p, ignore_errors=True)


def _libc_exchange():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


_RENAMEAT2 = _libc_exchange()
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swaps two directories in one atomic step; False where the system cannot."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: the filesystem cannot exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


def _put_in_place(staged: Path, out: Path, box: Path) -> None:
    if not out.exists():
        os.replace(staged, out)
    elif not _exchange(staged, out):
        os.replace(out, box / "old")  # a kill here leaves the old output in `box`: clean_stale restores it
        os.replace(staged, out)


@contextmanager
def staged_dir(out, overwrite: bool = False, inputs: Iterable = (), need_bytes: int = 0) -> Iterator[Path]:
    """Yields an empty staging directory; on success its content becomes `out` in one step.

    On any failure the staging directory is removed and an old `out` is left untouched."""
    out = check_output(out, inputs, overwrite, need_bytes)
    out.parent.mkdir(parents=True, exist_ok=True)
    box = Path(tempfile.mkdtemp(prefix=f".{out.name}{STAGING}.{os.getpid()}.", dir=out.parent))
    staged = box / "new"  # made by mkdir, so with normal permissions (mkdtemp's are private)
    try:
        staged.mkdir()
        yield staged
        _put_in_place(staged, out, box)
    finally:
        shutil.rmtree(box, ignore_errors=True)


@contextmanager
def atomic_file(path) -> Iterator[Path]:
    """A temporary path beside `path` for the block to write; put in `path`'s place in one rename when the
    block ends without an error, so a kill leaves the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    """Writes `text` atomically (see atomic_file)."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def cache_dir(kind: str) -> Path:
    """Where puzzlekit keeps what it can make again (`tokens`, `onnx`, op timings): $PUZZLEKIT_CACHE, by default
    ~/.cache/puzzlekit. A cache path that is (or lies below) something other than a directory is refused."""
    given = os.environ.get("PUZZLEKIT_CACHE")
    root = Path(given or Path.home() / ".cache" / "puzzlekit")
    base = _existing_ancestor(root / kind)
    if not base.is_dir():
        where = "PUZZLEKIT_CACHE" if given else "the cache directory"
        raise OutputError(f"{where} {root}: {base} is a file, not a directory; point PUZZLEKIT_CACHE at a directory "
                          "(or remove the file)")
    return root / kind


def write_json(path: Path, data) -> None:
    """Writes `data` as JSON atomically; numpy scalars become floats."""
    write_text(path, json.dumps(data, indent=1, default=float) + "\n")
