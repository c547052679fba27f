"""Textual pipelines: `name{key=value,...}` elements separated by commas, `name{opts}(nested, ...)`.

Options are typed from the pass's dataclass fields (int, float, bool, str, enums and lists of
those). Printing gives the canonical form (only options that differ from their defaults), and
parse(print(p)) == p.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import re
import typing
from pathlib import Path

from ..errors import read_text
from .core import PASSES, Pass, PassError

_BARE = re.compile(r"[A-Za-z0-9_.+\-/:*@]+")
PIPELINES_DIR = Path(__file__).resolve().parent.parent / "tools" / "pipelines"


class PipelineSyntaxError(PassError):
    def __init__(self, msg: str, text: str, pos: int):
        super().__init__(f"{msg} at position {pos}:\n  {text}\n  {' ' * pos}^")
        self.pos = pos


# -- types ------------------------------------------------------------------------------------------------
def _fields(cls) -> dict[str, tuple[object, object]]:
    """name -> (type, default) of a pass's options; the default is dataclasses.MISSING for required ones."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name != "body":
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            out[f.name] = (hints[f.name], default)
    return out


def describe_options(cls) -> list[dict]:
    """Each option's name, type and default (None when required), for help and listings."""
    return [{"name": k, "type": type_name(t), "required": d is dataclasses.MISSING,
             "default": None if d is dataclasses.MISSING else _format_value(d)} for k, (t, d) in _fields(cls).items()]


def type_name(tp) -> str:
    if typing.get_origin(tp) in (list, tuple):
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "|".join(m.name for m in tp)
    return getattr(tp, "__name__", str(tp))


def _coerce(raw, tp, where: str):
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        if not isinstance(raw, list):
            raw = [raw]
        (elem, *_) = typing.get_args(tp) or (str,)
        return [_coerce(r, elem, where) for r in raw]
    if isinstance(raw, list):
        raise PassError(f"{where}: expected {type_name(tp)}, got a list")
    s = raw
    try:
        if tp is bool:
            if s.lower() in ("true", "1", "yes"):
                return True
            if s.lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if tp is int:
            return int(s)
        if tp is float:
            if not math.isfinite(float(s)):
                raise PassError(f"{where}: {s!r} is not a finite float")
            return float(s)
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return tp[s]
        if tp is str:
            return s
    except (ValueError, KeyError):
        raise PassError(f"{where}: {s!r} is not a valid {type_name(tp)}") from None
    raise PassError(f"{where}: options of type {type_name(tp)} are not supported")


def _format_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_format_value(x) for x in v) + "]"
    if isinstance(v, enum.Enum):
        return v.name
    if isinstance(v, float):
        return repr(v)
    s = str(v)
    if isinstance(v, str) and (not _BARE.fullmatch(s)):
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return s


# -- printing ------------------------------------------------------------------------------------------------
def print_pipeline(passes: list[Pass]) -> str:
    out = []
    for p in passes:
        defaults = _fields(type(p))
        opts = [f"{k}={_format_value(v)}" for k, v in p.options().items()
                if k in defaults and (defaults[k][1] is dataclasses.MISSING or v != defaults[k][1])]
        s = p.pass_name + ("{" + ",".join(opts) + "}" if opts else "")
        if p.nested:
            s += "(" + print_pipeline(p.body) + ")"
        out.append(s)
    return ",".join(out)


# -- parsing --------------------------------------------------------------------------------------------------
class _Parser:
    def __init__(self, text: str):
        self.text, self.pos = text, 0

    def fail(self, msg: str, pos: int | None = None):
        raise PipelineSyntaxError(msg, self.text, self.pos if pos is None else pos)

    def skip(self):
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self) -> str:
        self.skip()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expect(self, ch: str):
        if self.peek() != ch:
            self.fail(f"expected {ch!r}" + (f", found {self.peek()!r}" if self.peek() else ", found the end"))
        self.pos += 1

    def token(self, what: str) -> tuple[str, int]:
        self.skip()
        m = _BARE.match(self.text, self.pos)
        if not m:
            self.fail(f"expected {what}")
        self.pos = m.end()
        return m.group(), m.start()

    def value(self):
        ch = self.peek()
        if ch == "[":
            self.pos += 1
            items = []
            if self.peek() != "]":
                items.append(self.value())
                while self.peek() == ",":
                    self.pos += 1
                    items.append(self.value())
            self.expect("]")
            return items
        if ch == '"':
            start, self.pos, buf = self.pos, self.pos + 1, []
            while self.pos < len(self.text) and self.text[self.pos] != '"':
                if self.text[self.pos] == "\\" and self.pos + 1 < len(self.text):
                    self.pos += 1
                buf.append(self.text[self.pos])
                self.pos += 1
            if self.pos >= len(self.text):
                self.fail("unterminated string", start)
            self.pos += 1
            return "".join(buf)
        return self.token("a value")[0]

    def pipeline(self, closing: str = "") -> list[Pass]:
        passes = [self.element()]
        while self.peek() == ",":
            self.pos += 1
            passes.append(self.element())
        if self.peek() != closing:
            found = f"found {self.peek()!r}" if self.peek() else "found the end"
            self.fail(f"expected ',' or {closing!r}, {found}" if closing else f"expected ',', {found}")
        return passes

    def element(self) -> Pass:
        name, at = self.token("a pass name")
        if name not in PASSES:
            near = difflib.get_close_matches(name, list(PASSES), n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else f"; known passes: {', '.join(sorted(PASSES))}"
            self.fail(f"unknown pass {name!r}{hint}", at)
        cls = PASSES[name]
        fields = _fields(cls)
        opts = {}
        if self.peek() == "{":
            self.pos += 1
            while self.peek() != "}":
                key, kat = self.token("an option name")
                if key not in fields:
                    valid = ", ".join(f"{k}: {type_name(t)}" for k, (t, _) in fields.items()) or "none"
                    self.fail(f"pass {name!r} has no option {key!r}; valid options: {valid}", kat)
                self.expect("=")
                vat = self.pos
                raw = self.value()
                try:
                    opts[key] = _coerce(raw, fields[key][0], f"option {key} of pass {name!r}")
                except PassError as e:
                    self.fail(str(e), vat)
                if self.peek() == ",":
                    self.pos += 1
                elif self.peek() != "}":
                    self.fail("expected ',' or '}'")
            self.pos += 1
        missing = [f"{k}: {type_name(t)}" for k, (t, d) in fields.items() if d is dataclasses.MISSING and k not in opts]
        if missing:
            self.fail(f"pass {name!r} needs option(s) {', '.join(missing)}", at)
        try:
            p = cls(**opts)
        except PassError as e:  # already names the pass (see Pass.__post_init__)
            self.fail(str(e), at)
        except (TypeError, ValueError) as e:
            self.fail(f"pass {name!r}: {e}", at)
        p.given = frozenset(opts)  # what the text set: `auto` settings never change these
        if cls.nested:
            self.expect("(")
            p.body = self.pipeline(")")
            self.expect(")")
        return p


def parse_pipeline(text: str) -> list[Pass]:
    """Parses pipeline text; raises PipelineSyntaxError pointing at the offending position."""
    p = _Parser(text)
    if not p.peek():
        p.fail("empty pipeline")
    return p.pipeline()


def resolve_pipeline(arg: str) -> str:
    """A pipeline argument is a file path, the name of a file in tools/pipelines/, or pipeline text.

    A file that exists but cannot be read or is not UTF-8 is an error, not pipeline text."""
    for f in (Path(arg), PIPELINES_DIR / f"{arg}.pipeline"):
        try:
            if not f.is_file():
                continue
        except (OSError, ValueError):  # not a usable path (e.g. pipeline text longer than a file name)
            continue
        text = read_text(f, "pipeline file", PassError)
        lines = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
        return " ".join(ln for ln in lines if ln)
    return arg
