"""The pass manager, analyses and the built-in passes, on the default model."""
import pytest
import torch

from puzzlekit import ir
from puzzlekit.backends.torch import materialize, random_weights
from puzzlekit.passes import AnalysisManager, Instrumentation, Pass, PassError, PassManager, Preserved, register
from puzzlekit.tools.default_model import default_architecture


@pytest.fixture(scope="module")
def base():
    """The default architecture with weights large enough that every change shows in the logits."""
    return random_weights(default_architecture(), seed=0, std=0.2)


@pytest.fixture
def prog(base):
    return base.copy()


IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def logits(p):
    with torch.no_grad():
        return materialize(p)(IDS)[0]


def test_set_topk_changes_routing_and_outputs(prog, base):
    PassManager("set-topk{k=1,layers=[1]}").run(prog)
    moes = prog.blocks("moe")
    assert [n.op.top_k for n in moes] == [1, 2, 2, 2]
    assert prog.weights.names() == base.weights.names()
    assert not torch.allclose(logits(prog), logits(base), atol=1e-4)
    # routing to every expert with k=experts equals the dense mixture of all experts: outputs change again
    other = base.copy()
    PassManager("set-topk{k=8}").run(other)
    assert all(n.op.top_k == 8 for n in other.blocks("moe"))


def test_drop_blocks_is_identity_for_those_layers(prog, base):
    PassManager("drop-blocks{layers=[2,6]}").run(prog)
    assert [prog.blocks()[i].op.kind for i in (2, 6)] == ["noop", "noop"]
    assert not any(k.startswith("backbone.layers.2.") for k in prog.weights.names())
    ir.verify(prog)
    # oracle: run the base model's modules by hand, skipping layers 2 and 6
    m = materialize(base)
    with torch.no_grad():
        x = m.backbone.embeddings(IDS)
        for i, n in enumerate(base.blocks()):
            if i not in (2, 6):
                x = m.get_submodule(n.path)(x)[0]
        want = m.lm_head(m.backbone.norm_f(x))
    torch.testing.assert_close(logits(prog), want, atol=1e-5, rtol=1e-5)


def test_analyses_are_cached_and_invalidated_by_what_passes_preserve(prog):
    am = AnalysisManager(prog)
    first = am.get("param-counts")
    PassManager("verify,print-ir").run(prog, am)
    assert am.get("param-counts") is first and am.computed == ["param-counts"]
    PassManager("set-topk{k=1}").run(prog, am)  # weights_only: structure changed, so counts go
    second = am.get("param-counts")
    assert am.computed == ["param-counts"] * 2 and second["active"] < first["active"]
    PassManager("drop-blocks{layers=[0]}").run(prog, am)
    third = am.get("param-counts")
    assert am.computed == ["param-counts"] * 3 and third["total"] < second["total"]
    assert third["total"] == prog.param_counts()["total"]


def test_preserved_sets():
    from puzzlekit.passes.core import ANALYSES
    counts = ANALYSES["param-counts"]
    assert Preserved.all().keeps(counts) and Preserved.structure_only().keeps(counts)
    assert not Preserved.weights_only().keeps(counts) and not Preserved.none().keeps(counts)
    assert Preserved.none().keep("param-counts").keeps(counts)


def test_snapshot_is_frozen(prog):
    am = PassManager("snapshot{name=teacher},set-topk{k=1},drop-blocks{layers=[0]}").run(prog)
    teacher = am.snapshots["teacher"]
    assert teacher.blocks()[0].op.kind == "mamba2" and teacher.blocks("moe")[0].op.top_k == 2
    assert "backbone.layers.0.mixer.in_proj.weight" in teacher.weights
    ir.verify(teacher)


def test_repeat_runs_its_body_n_times(prog):
    calls = []

    @register("test-count")
    def count(p, am):
        calls.append(1)
        return Preserved.all()

    PassManager("repeat{n=3}(test-count,verify)").run(prog)
    assert len(calls) == 3


def test_failures_name_the_pass_and_what_ran_before(prog):
    @register("test-boom")
    class Boom(Pass):
        """Always fails."""

        def run(self, p, am):
            raise RuntimeError("kaboom")

    with pytest.raises(PassError) as e:
        PassManager("verify,set-topk{k=1},test-boom").run(prog)
    msg = str(e.value)
    assert "pass test-boom failed: RuntimeError: kaboom" in msg
    assert "passes run before it: verify, set-topk{k=1}" in msg
    with pytest.raises(PassError, match=r"set-topk\{k=9\} failed: set-topk: k=9 must be in 1..8"):
        PassManager("set-topk{k=9}").run(prog)


def test_verify_each_catches_a_broken_pass(prog):
    @register("test-break")
    def breaker(p, am):
        n = p.blocks("moe")[0]
        p.nodes[p.nodes.index(n)] = ir.Node(n.name, n.op.replace(top_k=99), n.args, n.path)
        return Preserved.none()

    PassManager("test-break").run(prog.copy())  # unnoticed without verification
    with pytest.raises(PassError, match="top_k=99 exceeds experts=8"):
        PassManager("test-break", Instrumentation(verify_each=True)).run(prog)


def test_timings_and_print_ir_after(prog, capsys):
    ins = Instrumentation(print_ir_after=True)
    PassManager("verify,set-topk{k=1}", ins).run(prog)
    assert [n for n, _ in ins.timings] == ["verify", "set-topk{k=1}"]
    err = capsys.readouterr().err
    assert "// IR after set-topk{k=1}" in err and "top_k=1" in err


def test_the_manager_logs_each_pass_as_it_starts_and_ends(prog):
    """What compress prints on stderr as it goes (piped or not; --json keeps it quiet)."""
    import io

    log = io.StringIO()
    PassManager("set-topk{k=1},verify", Instrumentation(log=True, out=log)).run(prog.copy())
    lines = log.getvalue().splitlines()
    assert lines[0] == "set-topk: started" and lines[1].startswith("set-topk: done in ")
    assert lines[2] == "verify: started" and len(lines) == 4
    quiet = io.StringIO()
    PassManager("verify", Instrumentation(out=quiet)).run(prog.copy())
    assert quiet.getvalue() == ""
