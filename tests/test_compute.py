"""The eager kernels against their export forms and brute force: routed MoE (stacked experts in batched
products, with and without gradients), fused attention, the chunk-by-chunk scan, importance's re-routing damage,
per-expert calibration and inference weights held in the compute dtype."""
from __future__ import annotations

import pytest
import torch

from puzzlekit.backends.torch import hold_in, materialize
from puzzlekit.ir.ops import Attention, Mamba2, MoE
from puzzlekit.ir.ops.base import relu2, use_export_form
from puzzlekit.passes.puzzle.importance import _moe_stats, _Sums

TOL = 1e-5


def _rel(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp(min=1.0)).item()


def _block(spec, seed=0):
    torch.manual_seed(seed)
    b = spec.build()
    with torch.no_grad():
        for name, p in b.named_parameters():
            if not name.endswith(("A_log", "dt_bias")):
                p.normal_(0, 0.3)
        for name, t in b.named_buffers():
            t.normal_(0, 0.1)
    return b


MOES = {"plain": MoE(hidden=32, experts=16, top_k=3, d_ff=24, shared_d_ff=16, scaling=2.0),
        "latent": MoE(hidden=32, experts=16, top_k=3, d_ff=24, shared_d_ff=0, latent=16, norm_topk=False)}


@pytest.mark.parametrize("name", list(MOES))
def test_routed_moe_equals_every_expert_form(name):
    block = _block(MOES[name])
    x = torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(1))
    dense = _block(MOES[name])
    use_export_form(dense)
    with torch.no_grad():
        want, want_dec = dense(x)[0], dense(x[:, :1], None, True)[0]
    with_grad = block(x)[0]  # gradients on
    with torch.no_grad():
        routed, routed_dec = block(x)[0], block(x[:, :1], None, True)[0]
    assert want.abs().max() > 0.1
    for got in (with_grad, routed):
        assert _rel(got, want) < TOL
    assert _rel(routed_dec, want_dec) < TOL


def _expert(mixer, j, rows):
    """Expert j alone, written out from its two stacked matrices (the brute-force oracle)."""
    return relu2(rows @ mixer.experts.up_proj[j].T) @ mixer.experts.down_proj[j].T


def test_routed_moe_runs_each_expert_on_its_tokens_only():
    """The work follows top-k: every expert sees exactly the tokens that chose it, and its output for each of
    them is that expert's alone (brute force, one expert at a time)."""
    spec = MOES["plain"]
    block = _block(spec)
    x = torch.randn(40, spec.hidden, generator=torch.Generator().manual_seed(2))
    chosen, _ = block.mixer.route(x)
    seen = []
    with torch.no_grad():
        out = block.mixer.expert_outputs(x, chosen, lambda ids, rows, a: seen.append((ids, rows, a)))
        (ids, rows, a), = seen
        assert torch.equal(torch.bincount(ids, minlength=spec.experts), torch.bincount(chosen.reshape(-1),
                                                                                        minlength=spec.experts))
        assert len(ids) == 40 * spec.top_k and bool((ids[1:] >= ids[:-1]).all())  # sorted by expert
        for n in range(40):
            for slot in range(spec.top_k):
                want = _expert(block.mixer, int(chosen[n, slot]), x[n:n + 1])[0]
                assert _rel(out[n, slot], want) < TOL


def test_a_layer_of_many_experts_is_a_few_modules_and_parameters():
    """512 experts are two stacked parameters, not 1,024 modules: the module tree does not grow with them."""
    small, large = (MoE(hidden=16, experts=e, top_k=2, d_ff=8, shared_d_ff=8).build() for e in (4, 512))
    assert len(list(large.modules())) == len(list(small.modules()))
    assert len(list(large.parameters())) == len(list(small.parameters()))
    assert large.mixer.experts.up_proj.shape == (512, 8, 16) and large.mixer.experts.down_proj.shape == (512, 16, 8)


def test_moe_calibration_amax_is_per_expert_over_its_tokens():
    spec = MOES["plain"]
    block = _block(spec)
    x = torch.randn(50, spec.hidden, generator=torch.Generator().manual_seed(3))
    block.mixer.__dict__["calib"] = {}
    with torch.no_grad():
        block.mixer(x[None])
    stats = block.mixer.__dict__.pop("calib")
    chosen, _ = block.mixer.route(x)
    for j in range(spec.experts):
        rows = x[(chosen == j).any(-1)]
        up = rows.abs().amax() if len(rows) else torch.tensor(0.0)
        down = relu2(rows @ block.mixer.experts.up_proj[j].T).abs().amax() if len(rows) else torch.tensor(0.0)
        assert torch.allclose(stats["up"][j], up) and torch.allclose(stats["down"][j], down.detach())


@pytest.mark.parametrize("name", list(MOES))
def test_importance_damage_equals_rerouting_by_brute_force(name):
    """Removing an expert = its selection score at -inf, the native top-k choosing again (the oracle runs the
    mixer once per removed expert, every expert on every token)."""
    spec = MOES[name]
    block = _block(spec)
    h = torch.randn(2, 30, spec.hidden, generator=torch.Generator().manual_seed(4))
    acc = _Sums()
    with torch.no_grad():
        _moe_stats(block.mixer, h, acc)
        flat = h.reshape(-1, spec.hidden)
        lat = block.mixer.fc1_latent_proj(flat) if spec.latent else flat
        every = torch.stack([_expert(block.mixer, j, lat) for j in range(spec.experts)], 1)  # [n, E, w]

        def routed(bias):
            chosen, w = block.mixer.route(flat, bias)
            mix = torch.zeros(flat.shape[0], spec.experts).scatter(1, chosen, w)
            return torch.einsum("new,ne->nw", every, mix), mix != 0
        y, chosen = routed(torch.zeros(spec.experts))
        damage = []
        for e in range(spec.experts):
            mask = torch.zeros(spec.experts)
            mask[e] = float("-inf")
            damage.append((routed(mask)[0] - y).pow(2).sum())
    assert torch.equal(acc.sums["routing"], chosen.double().sum(0))
    assert _rel(acc.sums["damage"], torch.stack(damage).double()) < TOL
    a = torch.stack([relu2(lat @ block.mixer.experts.up_proj[j].T) for j in range(spec.experts)], 1)  # [n, E, d_ff]
    assert _rel(acc.sums["d_ff"], (a.abs() * chosen[..., None]).sum(0).double().detach()) < TOL


def test_fused_attention_equals_written_out():
    spec = Attention(hidden=32, q_heads=8, kv_heads=2, head_dim=8)
    fused, written = _block(spec), _block(spec)
    use_export_form(written)
    x = torch.randn(2, 19, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for b in (fused, written):
            b.out = [b(x)[0]]
            y1, s1 = b(x[:, :6])
            y2, s2 = b(x[:, 6:18], s1)  # a chunk after cached tokens
            y3, _ = b(x[:, 18:], s2, True)  # one token
            b.out.append(torch.cat([y1, y2, y3], 1))
    for got, want in zip(fused.out, written.out):
        assert want.abs().max() > 0.1 and _rel(got, want) < TOL
    assert _rel(fused.out[1], fused.out[0]) < TOL  # cached = uncached


def test_chunk_by_chunk_scan_equals_the_decay_matrix_form():
    spec = Mamba2(hidden=32, heads=4, head_dim=8, state=8, groups=2, chunk=4)
    loop, matrix = _block(spec), _block(spec)
    use_export_form(matrix)
    x = torch.randn(2, 23, 32, generator=torch.Generator().manual_seed(6))  # six chunks, the last one partial
    with torch.no_grad():
        (y1, (_, s1)), (y2, (_, s2)) = loop(x), matrix(x)
    assert y2.abs().max() > 0.1
    assert _rel(y1, y2) < TOL and _rel(s1, s2) < TOL


@pytest.mark.parametrize("chunk", [1, 3, 8, 32])
def test_grouped_scan_equals_the_token_by_token_recurrence(chunk):
    """The scan that runs (B and C per group, any chunk) against the SSM's definition, one token at a time:
    state = state * exp(dt A) + dt x B, y = state . C, from a given state; heads share their group's B, C."""
    from puzzlekit.ir.ops.mamba2 import ssd_grouped

    g = torch.Generator().manual_seed(8)
    b, t, h, groups, p, n = 2, 19, 6, 3, 4, 5
    x, B, C = torch.randn(b, t, h, p, generator=g), torch.randn(b, t, groups, n, generator=g), torch.randn(
        b, t, groups, n, generator=g)
    dt, A, init = torch.rand(b, t, h, generator=g), -torch.rand(h, generator=g) - 0.1, torch.randn(b, h, p, n, generator=g)
    Bh, Ch = B.repeat_interleave(h // groups, 2), C.repeat_interleave(h // groups, 2)
    state, want = init.double(), []
    for i in range(t):
        decay = torch.exp(dt[:, i] * A).double()[..., None, None]
        state = state * decay + (dt[:, i, :, None] * x[:, i]).double()[..., None] * Bh[:, i, :, None].double()
        want.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, i].double()))
    y, final = ssd_grouped(x, dt, A, B, C, chunk, init)
    assert _rel(y, torch.stack(want, 1).float()) < TOL and _rel(final, state.float()) < TOL


def test_inference_weights_are_cast_once_to_the_same_numbers(make_small_program):
    """bf16 inference: Linear weights held in bf16, routers and norms as stored, and the logits bit for bit
    those of autocast casting every weight on every call."""
    from puzzlekit.backends.torch.device import Compute

    prog = make_small_program()
    compute = Compute(torch.device("cpu"), torch.bfloat16)
    held, cast = materialize(prog, compute=compute, inference=True), materialize(prog, compute=compute)
    ids = torch.randint(0, prog.find("embed")[0].op.vocab, (2, 9), generator=torch.Generator().manual_seed(7))
    dtypes = {n: p.dtype for n, p in held.named_parameters()}
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if n.endswith(("proj.weight", "conv1d.weight")))
    assert all(d == torch.float32 for n, d in dtypes.items() if "norm" in n or ".gate." in n)
    experts = [d for n, d in dtypes.items() if n.endswith(("experts.up_proj", "experts.down_proj"))]
    assert experts and all(d == torch.bfloat16 for d in experts)
    with torch.no_grad():
        a, b = held(ids), cast(ids)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert hold_in(held, torch.float32) is held


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_moe_gradients_equal_the_every_expert_form(dtype):
    """Training runs the experts as one autograd node with its own backward: its gradients (inputs, every
    expert's weights, the router's) against autograd through the every-expert form; under bf16 autocast both
    compute in bf16, so they agree to bf16's precision."""
    spec = MOES["plain"]
    fused, dense = _block(spec), _block(spec)
    use_export_form(dense)
    x = torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(8))
    grads = []
    for b in (fused, dense):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            b(xi)[0].float().pow(2).mean().backward()
        grads.append([xi.grad] + [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.parameters()])
    tol = TOL if dtype == torch.float32 else 2e-2
    assert grads[1][0].abs().max() > 0
    for got, want in zip(*grads):
        assert _rel(got, want) < tol


def test_streamed_layers_hold_their_experts_in_the_dtype_they_compute_in(make_small_program):
    """A bf16 checkpoint read in float32 (importance, scoring): the stacked experts are float32, with the
    checkpoint's values expert by expert."""
    from puzzlekit.backends.torch.stream import StreamedProgram

    prog = make_small_program(dtype=torch.bfloat16)
    node = prog.blocks("moe")[0]
    mixer = StreamedProgram(prog, dtype=torch.float32).module(node).mixer
    assert mixer.experts.up_proj.dtype == torch.float32
    for j in range(node.op.experts):
        stored = prog.weights.get(f"{node.path}.mixer.experts.{j}.up_proj.weight")
        assert torch.equal(mixer.experts.up_proj[j], stored.float())


def test_weights_held_in_bf16_leave_static_activation_scales_in_float32():
    """An FP8 W8A8 program's inputs are quantized by the calibrated float32 scales, as the engines quantize them,
    whatever precision the weights are held in."""
    from puzzlekit.backends.torch.device import Compute
    from puzzlekit.passes import PassManager
    from puzzlekit.tools.default_model import load_default

    prog = load_default()
    PassManager("quantize{recipe=fp8,samples=1,seq=16}").run(prog)
    held = materialize(prog, compute=Compute(torch.device("cpu"), torch.bfloat16), inference=True)
    scales = {n: b for n, b in held.named_buffers() if "input_scale" in n}
    assert scales and all(b.dtype == torch.float32 for b in scales.values())
    name = "backbone.layers.0.mixer.in_proj.input_scale"
    assert scales[name].item() == prog.weights.get(name).item()
    assert held.get_submodule("backbone.layers.0.mixer.in_proj").weight.dtype == torch.bfloat16


def test_the_grouped_gemm_runs_on_cpu_where_it_beats_the_padded_form():
    """torch's CPU grouped GEMM pays a fixed cost for every expert of the layer: it is taken for 16-byte aligned
    rows (its kernel refuses others) when the experts average 8 rows or the used experts' weights are large (the
    padded form would copy them); not for a few rows over many small experts."""
    from puzzlekit.ir.ops.routed import _grouped_here

    counts = torch.tensor([16, 0, 0, 0])  # 16 rows over 4 experts, one used
    assert _grouped_here(torch.zeros(32, 8), counts * 2, torch.zeros(4, 12, 8))  # 8 rows per expert
    assert not _grouped_here(torch.zeros(16, 8), counts, torch.zeros(4, 12, 8))  # few rows, small experts
    assert _grouped_here(torch.zeros(16, 64), counts, torch.zeros(4, 64, 64))  # one used expert of 4,096 weights
    assert not _grouped_here(torch.zeros(32, 8, dtype=torch.bfloat16), counts * 2, torch.zeros(4, 12, 8))
    assert not _grouped_here(torch.zeros(32, 6), counts * 2, torch.zeros(4, 12, 6))  # 24-byte rows


@pytest.mark.parametrize("form", ["_padded", "_grouped"])
@pytest.mark.parametrize("skew", [0.0, 3.0])
def test_expert_products_equal_one_expert_at_a_time(skew, form):
    """The padded form (evenly routed rows as one padded batch, skewed ones in buckets of experts with about as
    many rows) and torch's grouped GEMM on CPU: values and gradients are each expert's own MLP over its rows,
    against a loop over the experts."""
    from puzzlekit.ir import ops

    run = getattr(ops.routed, form)

    g = torch.Generator().manual_seed(9)
    E, n, w, f = 16, 300, 8, 12
    weights = torch.arange(1, E + 1).float() ** skew
    counts = torch.multinomial(weights, n, replacement=True, generator=g).bincount(minlength=E)
    rows = torch.randn(n, w, generator=g, requires_grad=True)
    up = torch.randn(E, f, w, generator=g, requires_grad=True)
    down = torch.randn(E, w, f, generator=g, requires_grad=True)
    seen = []
    got = run(rows, counts, up, down, lambda a: a, seen.append)
    starts = (torch.cumsum(counts, 0) - counts).tolist()
    hidden = [torch.relu(rows[s:s + c] @ up[e].T).square() for e, (s, c) in enumerate(zip(starts, counts.tolist()))]
    want = torch.cat([h @ down[e].T for e, h in enumerate(hidden)])
    assert _rel(got, want) < TOL and _rel(seen[0], torch.cat(hidden)) < TOL
    for loss in (lambda y: y.square().sum(), lambda y: y.sum()):  # .sum()'s gradient is expanded (stride 0)
        grads = torch.autograd.grad(loss(got), (rows, up, down), retain_graph=True)
        for a, b in zip(grads, torch.autograd.grad(loss(want), (rows, up, down), retain_graph=True)):
            assert _rel(a, b) < TOL
