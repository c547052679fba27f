"""Pipeline text: parse -> print -> parse is exact; errors point at the position."""
import enum
from dataclasses import field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from puzzlekit.passes import (PASSES, Pass, PassError, PipelineSyntaxError, Preserved, parse_pipeline,
                              print_pipeline, register, resolve_pipeline)

from puzzlekit.passes.pipeline import PIPELINES_DIR

class Mode(enum.Enum):
    amax = 1
    mse = 2


@register("test-options")
class OptionsPass(Pass):
    """A pass with one option of every supported type."""

    i: int = 0
    f: float = 0.5
    b: bool = False
    s: str = "x"
    m: Mode = Mode.amax
    li: list[int] = field(default_factory=list)
    ls: list[str] = field(default_factory=list)

    def run(self, prog, am):
        return Preserved.all()


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
_options = st.builds(OptionsPass, i=st.integers(-10**6, 10**6), f=st.floats(allow_nan=False, allow_infinity=False),
                     b=st.booleans(), s=_text, m=st.sampled_from(Mode), li=st.lists(st.integers(-99, 99), max_size=4),
                     ls=st.lists(_text, max_size=3))


def _pipelines(depth=2):
    leaf = st.one_of(_options, st.builds(PASSES["set-topk"], k=st.integers(1, 8),
                                         layers=st.lists(st.integers(0, 20), max_size=3)))
    if depth == 0:
        return st.lists(leaf, min_size=1, max_size=3)

    def rep(n, body):
        p = PASSES["repeat"](n=n)
        p.body = body
        return p
    nested = st.builds(rep, st.integers(1, 4), _pipelines(depth - 1))
    return st.lists(st.one_of(leaf, nested), min_size=1, max_size=3)


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert type(x) is type(y) and x.options() == y.options()
        if x.nested:
            _same(x.body, y.body)


@settings(max_examples=200, deadline=None)
@given(_pipelines())
def test_print_parse_roundtrip(passes):
    text = print_pipeline(passes)
    again = parse_pipeline(text)
    _same(again, passes)
    assert print_pipeline(again) == text


def test_whitespace_and_defaults_normalise():
    p = parse_pipeline(' verify , test-options{ i = 3 , s="a b" , li=[1, 2] } , repeat{n=2}( verify ) ')
    assert print_pipeline(p) == 'verify,test-options{i=3,s="a b",li=[1,2]},repeat{n=2}(verify)'
    assert p[1].i == 3 and p[1].li == [1, 2] and p[1].s == "a b" and p[1].m is Mode.amax


def test_typed_values():
    p = parse_pipeline("test-options{i=-4,f=1e-3,b=true,m=mse,ls=[a,\"b,c\"]}")[0]
    assert (p.i, p.f, p.b, p.m, p.ls) == (-4, 1e-3, True, Mode.mse, ["a", "b,c"])


@pytest.mark.parametrize("text,pos,words", [
    ("verify,set-topk{k=2", 19, ["expected ',' or '}'"]),
    ("verfy", 0, ["unknown pass 'verfy'", "did you mean verify"]),
    ("verify,drop-blokcs{layers=[1]}", 7, ["did you mean drop-blocks"]),
    ("set-topk{kk=3}", 9, ["no option 'kk'", "k: int", "layers: list[int]"]),
    ("set-topk{k=two}", 11, ["'two' is not a valid int"]),
    ("test-options{m=max}", 15, ["not a valid amax|mse"]),
    ("test-options{b=maybe}", 15, ["not a valid bool"]),
    ("set-topk", 0, ["needs option(s) k: int"]),
    ("repeat{n=2}(verify", 18, ["expected ',' or ')', found the end"]),
    ("verify)", 6, ["expected ',', found ')'"]),
    ("verify,,verify", 7, ["expected a pass name"]),
    ('snapshot{name="open', 14, ["unterminated string"]),
    ("", 0, ["empty pipeline"]),
])
def test_errors_point_at_the_position(text, pos, words):
    with pytest.raises(PipelineSyntaxError) as e:
        parse_pipeline(text)
    assert e.value.pos == pos
    msg = str(e.value)
    for w in words:
        assert w in msg
    caret_line = msg.splitlines()[-1]
    assert caret_line == "  " + " " * pos + "^"


def test_named_pipeline_files(tmp_path):
    assert parse_pipeline(resolve_pipeline("smoke"))[0].pass_name == "verify"
    f = tmp_path / "mine.pipeline"
    f.write_text("# comment\nverify,  # trailing\nset-topk{k=1}\n")
    assert print_pipeline(parse_pipeline(resolve_pipeline(str(f)))) == "verify,set-topk{k=1}"
    assert resolve_pipeline("verify") == "verify"


def test_function_passes_and_duplicate_names():
    @register("test-fn")
    def scale(prog, am, factor: float = 2.0, names: list[str] = ()):  # noqa: B006
        """Does nothing, with options."""
        return Preserved.all()

    p = parse_pipeline("test-fn{factor=3,names=[a,b]}")[0]
    assert p.factor == 3.0 and p.names == ["a", "b"] and PASSES["test-fn"].doc() == "Does nothing, with options."
    assert print_pipeline([p]) == "test-fn{factor=3.0,names=[a,b]}"
    with pytest.raises(PassError, match="already registered"):
        register("verify")(scale)


@pytest.mark.parametrize("name", sorted(p.stem for p in PIPELINES_DIR.glob("*.pipeline") if "$" not in p.read_text()))
def test_every_shipped_pipeline_parses_and_round_trips(name):  # templates ($names): tests/test_compress.py
    passes = parse_pipeline(resolve_pipeline(name))
    assert parse_pipeline(print_pipeline(passes)) == passes
