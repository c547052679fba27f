"""Prefill / decode consistency of every block kind, plus independent oracles for MoE routing and Mamba-2.

Every program here is tiny (hidden 32, vocab 64) and filled with large-ish random weights (std 0.3) so that
logits are O(1) and a wrong state, a wrong mask or a wrong expert shows up far above the 1e-5 tolerance.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from puzzlekit import ir
from puzzlekit.backends.torch import load_tensors, materialize, random_weights
from puzzlekit.ir.ops import MLP, MTP, Attention, Embed, Linear, LMHead, Mamba2, MoE, Noop, Norm

H, VOCAB, T = 32, 64, 9
TOL = 1e-5  # relative to the magnitudes compared (see _rel)


def _rel(got, want) -> float:
    """Largest difference relative to the magnitude of `want` (at least 1): fp32 results differ between CPUs."""
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def _mamba(**kw):
    return Mamba2(H, heads=4, head_dim=8, state=8, groups=2, **{"chunk": 4, **kw})


def _blocks(kind: str):
    """(trunk blocks, mtp spec or None) for one program kind."""
    if kind == "mamba2":
        return [_mamba(), _mamba(dt_min=0.02)], None
    if kind == "mamba2_no_conv_bias":
        return [_mamba(chunk=3, conv_bias=False), _mamba(chunk=16)], None
    if kind == "moe":
        return [MoE(H, 4, 2, 16, 24, scaling=2.0), MoE(H, 4, 2, 16, 24, scaling=2.0)], None
    if kind == "moe_latent":
        return [MoE(H, 4, 2, 16, 24, latent=16, scaling=2.0), MoE(H, 6, 3, 8, 0, latent=8, norm_topk=False)], None
    if kind == "attention":
        return [Attention(H, 4, 2, 8), Attention(H, 4, 4, 8)], None
    if kind == "mlp":
        return [MLP(H, 48), MLP(H, 48)], None
    if kind == "noop":
        return [Noop(H), Noop(H)], None
    if kind == "linear":
        return [Linear(H), Linear(H)], None
    if kind == "hybrid":
        return [_mamba(), MoE(H, 4, 2, 16, 24, latent=16), Attention(H, 4, 2, 8), MLP(H, 48), Noop(H),
                Linear(H), _mamba()], None
    if kind == "mtp":
        return [_mamba(), MoE(H, 4, 2, 16, 24), Attention(H, 4, 2, 8)], \
            MTP(H, (Attention(H, 4, 2, 8), MoE(H, 4, 2, 16, 24, scaling=2.0)))
    if kind == "mtp_mamba":  # an MTP head whose own blocks carry recurrent and KV state
        return [Attention(H, 4, 2, 8), _mamba()], \
            MTP(H, (_mamba(), Attention(H, 4, 1, 8), MoE(H, 4, 2, 16, 24, latent=8)))
    raise KeyError(kind)


KINDS = ["mamba2", "mamba2_no_conv_bias", "moe", "moe_latent", "attention", "mlp", "noop", "linear", "hybrid",
         "mtp", "mtp_mamba"]


def _perturb(prog, seed: int):
    """random_weights leaves norms at 1, biases and correction biases at 0, D at 1: make them non-trivial."""
    g = torch.Generator().manual_seed(seed + 1000)
    for name in prog.weights.names():
        t = prog.weights.get(name)
        if name.endswith("norm.weight"):
            prog.weights.set(name, 1 + 0.1 * torch.randn(t.shape, generator=g))
        elif name.endswith("e_score_correction_bias"):
            prog.weights.set(name, 0.05 * torch.randn(t.shape, generator=g))
        elif name.endswith("conv1d.bias"):
            prog.weights.set(name, 0.2 * torch.randn(t.shape, generator=g))
        elif name.endswith("mixer.D"):
            prog.weights.set(name, 1 + 0.3 * torch.randn(t.shape, generator=g))
    return prog


def _program(kind: str, seed: int = 0):
    blocks, mtp = _blocks(kind)
    prog = ir.assemble(Embed(VOCAB, H), blocks, Norm(H), LMHead(VOCAB, H), mtp)
    random_weights(prog, seed=seed, std=0.3)
    _perturb(prog, seed)
    ir.verify(prog)
    return prog


def _ids(b=2, t=T, seed=0):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _maxdiff(a, b):
    assert len(a) == len(b)
    out = 0.0
    for x, y in zip(a, b):
        assert x.shape == y.shape, (x.shape, y.shape)
        out = max(out, _rel(x.float(), y.float()) if x.numel() else 0.0)
    return out


@pytest.fixture(scope="module", params=KINDS)
def kind_model(request):
    prog = _program(request.param)
    return request.param, prog, materialize(prog)


# -- prefill == forward, state layout -----------------------------------------------------------------
def test_forward_equals_prefill_and_state_layout(kind_model):
    kind, prog, m = kind_model
    ids = _ids()
    with torch.no_grad():
        fwd = m(ids)
        outs, state = m.prefill(ids)
    fwd = fwd if isinstance(fwd, tuple) else (fwd,)
    assert len(outs) == len(prog.outputs) == (2 if kind.startswith("mtp") else 1)
    assert _maxdiff(fwd, outs) == 0.0
    assert outs[0].shape == (2, T, VOCAB)
    assert outs[0].abs().max() > 0.1
    # the state has one tensor per declared state name, with the declared shape
    assert len(state) == len(m.state_names)
    shapes = {f"{n.path}.{k}": v for n in prog.nodes for k, v in n.op.state_shapes().items()}
    assert list(shapes) == m.state_names
    for name, s in zip(m.state_names, state):
        want = tuple({"B": 2, "L": T}.get(d, d) for d in shapes[name])
        assert tuple(s.shape) == want, name


# -- prefill of a prefix, then one-token decode steps ---------------------------------------------------------
@pytest.mark.parametrize("prefix", [1, 3])
def test_decode_matches_full_prefill(kind_model, prefix):
    kind, prog, m = kind_model
    ids = _ids(seed=1)
    with torch.no_grad():
        full, full_state = m.prefill(ids)
        steps, state = m.prefill(ids[:, :prefix])
        steps = [list(steps)]
        for t in range(prefix, T):
            o, state = m.decode(ids[:, t], state)
            assert all(x.shape[1] == 1 for x in o)
            steps.append(list(o))
    dec = tuple(torch.cat([s[i] for s in steps], dim=1) for i in range(len(full)))
    for i, name in enumerate(prog.outputs):
        d = _rel(dec[i], full[i])
        assert d < TOL, f"{kind}: output {name} differs between prefill and decode by {d}"
        assert full[i].abs().max() > 0.1
    # the state after decoding equals the state after the full prefill
    for name, a, b in zip(m.state_names, full_state, state):
        assert a.shape == b.shape, name
        assert _rel(a.float(), b.float()) < TOL, f"{kind}: state {name} differs"


def test_decode_accepts_column_token_ids(kind_model):
    kind, prog, m = kind_model
    ids = _ids(seed=2)
    with torch.no_grad():
        _, st = m.prefill(ids[:, :4])
        a, sa = m.decode(ids[:, 4], st)
        b, sb = m.decode(ids[:, 4:5], st)
    assert _maxdiff(a, b) == 0.0 and _maxdiff(sa, sb) == 0.0


# -- prefill in pieces ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cuts", [(5,), (1, 4, 8)], ids=["5+4", "1+3+4+1"])
def test_chunked_prefill_matches_full_prefill(kind_model, cuts):
    kind, prog, m = kind_model
    ids = _ids(seed=3)
    bounds = [0, *cuts, T]
    with torch.no_grad():
        full, full_state = m.prefill(ids)
        parts, state = [], None
        for a, b in zip(bounds[:-1], bounds[1:]):
            o, state = m.prefill(ids[:, a:b], state)
            parts.append(o)
    joined = tuple(torch.cat([p[i] for p in parts], dim=1) for i in range(len(full)))
    for i, name in enumerate(prog.outputs):
        d = _rel(joined[i], full[i])
        assert d < TOL, f"{kind}: output {name} of the chunked prefill differs by {d}"
    for name, a, b in zip(m.state_names, full_state, state):
        assert a.shape == b.shape, name
        assert _rel(a.float(), b.float()) < TOL, f"{kind}: state {name} differs"


def test_batch_rows_are_independent(kind_model):
    """A sequence's logits do not depend on the other sequences of the batch (prefill and decode)."""
    kind, prog, m = kind_model
    ids = _ids(b=3, seed=4)
    with torch.no_grad():
        full, st = m.prefill(ids[:, :6])
        one, st1 = m.prefill(ids[1:2, :6])
        d_full, _ = m.decode(ids[:, 6], st)
        d_one, _ = m.decode(ids[1:2, 6], st1)
    assert _maxdiff([o[1:2] for o in full], one) < TOL
    assert _maxdiff([o[1:2] for o in d_full], d_one) < TOL


# -- MoE: the decode (gather) path equals the prefill (dense) path on many tokens --------------------------------
@pytest.mark.parametrize("latent", [0, 16])
def test_moe_gather_path_equals_dense_path(latent):
    prog = _program("moe_latent" if latent else "moe", seed=5)
    m = materialize(prog)
    blk = m.get_submodule("backbone.layers.0")
    x = torch.randn(3, 7, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        dense, _ = blk(x, None, False)
        gather, _ = blk(x, None, True)
    assert (dense - x).abs().max() > 0.1
    # outputs reach ~20 here: compare relative to their size (fp32 sums in a different order)
    assert _rel(gather, dense) < TOL


# -- MoE routing against a hand-written oracle ------------------------------------------------------------------------
def _moe_oracle(w: dict, spec: MoE, x: torch.Tensor):
    """Loop over tokens and experts: sigmoid scores, bias for the choice only, top-k, normalise, scale,
    relu^2 experts (in the latent width when there is one), shared expert on the normed input, residual."""
    xd = x.double().reshape(-1, spec.hidden)
    W = {k: v.double() for k, v in w.items()}
    out = torch.zeros_like(xd)
    chosen_all = []
    for n in range(xd.shape[0]):
        h = xd[n] / torch.sqrt(xd[n].pow(2).mean() + spec.eps) * W["norm.weight"]
        scores = torch.sigmoid(W["mixer.gate.weight"] @ h)
        biased = scores + W["mixer.gate.e_score_correction_bias"]
        order = sorted(range(spec.experts), key=lambda e: -biased[e].item())
        chosen = order[: spec.top_k]
        chosen_all.append(set(chosen))
        gates = torch.stack([scores[e] for e in chosen])
        if spec.norm_topk:
            gates = gates / gates.sum()
        gates = gates * spec.scaling
        hin = W["mixer.fc1_latent_proj.weight"] @ h if spec.latent else h
        acc = torch.zeros_like(hin)
        for g, e in zip(gates, chosen):
            up = W[f"mixer.experts.{e}.up_proj.weight"] @ hin
            acc = acc + g * (W[f"mixer.experts.{e}.down_proj.weight"] @ torch.relu(up) ** 2)
        y = W["mixer.fc2_latent_proj.weight"] @ acc if spec.latent else acc
        if spec.shared_d_ff:
            y = y + W["mixer.shared_experts.down_proj.weight"] @ torch.relu(W["mixer.shared_experts.up_proj.weight"] @ h) ** 2
        out[n] = xd[n] + y
    return out.reshape(x.shape), chosen_all


@pytest.mark.parametrize("latent,norm_topk,shared", [(0, True, 12), (4, False, 12), (4, True, 0)])
def test_moe_routing_and_output_match_oracle(latent, norm_topk, shared):
    hidden, E = 8, 4
    spec = MoE(hidden, E, 2, 6, shared, latent=latent, scaling=2.5, norm_topk=norm_topk)
    g = torch.Generator().manual_seed(7)
    w = {k: 0.5 * torch.randn(s, generator=g) for k, s in spec.params().items()}
    w["norm.weight"] = torch.ones(hidden)
    # token direction i gets router logits L[i] (a normed one-hot is sqrt(hidden) along i)
    L = torch.tensor([[3.0, 2.0, 0.0, -2.0],
                      [-2.0, 0.0, -3.0, 3.0],
                      [0.0, 3.0, -4.0, 2.0],
                      [2.0, -3.0, 1.0, 0.0]])
    router = torch.zeros(E, hidden)
    router[:, :4] = L.T / math.sqrt(hidden)
    w["mixer.gate.weight"] = router
    w["mixer.gate.e_score_correction_bias"] = torch.tensor([0.0, 0.0, 0.6, 0.0])
    # scores + bias pick {0,2} for dir 0 ({0,1} by score alone), {2,3} for dir 1 ({1,3} by score), {1,3}, {0,2}
    expected = [{0, 2}, {2, 3}, {1, 3}, {0, 2}]
    blk = load_tensors(spec.build(), w)  # the checkpoint's per-expert names
    blk.eval()
    designed = 3.0 * torch.eye(hidden)[:4] + 0.01 * torch.randn(4, hidden, generator=g)
    rand = torch.randn(5, hidden, generator=g)
    x = torch.cat([designed, rand])[None]  # [1, 9, hidden]
    want, chosen = _moe_oracle(w, spec, x)
    assert chosen[:4] == expected
    with torch.no_grad():
        ids, gates = blk.mixer.route(blk.norm(x).reshape(-1, hidden))
        assert [set(r.tolist()) for r in ids] == chosen
        # gates come from the unbiased scores
        for n in range(4):
            s = torch.sigmoid(blk.mixer.gate.weight @ blk.norm(x)[0, n])
            sel = s[ids[n]]
            ref = (sel / sel.sum() if norm_topk else sel) * 2.5
            assert torch.allclose(gates[n], ref, atol=1e-6)
        for decode in (False, True):
            y, st = blk(x, None, decode)
            assert st == ()
            assert _rel(y.double(), want) < TOL, f"decode={decode}"
    assert (want - x.double()).abs().max() > 0.1


# -- Mamba-2 against a naive per-timestep recurrence ----------------------------------------------------------------
def _mamba_oracle(w: dict, s: Mamba2, x: torch.Tensor):
    """Plain loop: causal depthwise conv, silu, softplus(dt + dt_bias) clamped at dt_min,
    state = state * exp(dt A) + dt x B^T, y = state C + D x, gated group RMSNorm, out_proj, residual."""
    W = {k: v.double() for k, v in w.items()}
    xd = x.double()
    b, t, _ = xd.shape
    inner, gn = s.heads * s.head_dim, s.groups * s.state
    conv_dim = inner + 2 * gn
    u = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + s.eps) * W["norm.weight"]
    proj = u @ W["mixer.in_proj.weight"].T
    z, xbc, dt_raw = proj[..., :inner], proj[..., inner:inner + conv_dim], proj[..., inner + conv_dim:]
    assert dt_raw.shape[-1] == s.heads
    cw = W["mixer.conv1d.weight"][:, 0, :]  # [conv_dim, K]
    K = s.conv
    conv = torch.zeros(b, t, conv_dim, dtype=torch.float64)
    for i in range(t):
        acc = W["mixer.conv1d.bias"].expand(b, conv_dim).clone() if s.conv_bias else torch.zeros(b, conv_dim,
                                                                                                 dtype=torch.float64)
        for k in range(K):
            src = i - (K - 1) + k
            if src >= 0:
                acc = acc + cw[:, k] * xbc[:, src]
        conv[:, i] = acc
    act = F.silu(conv)
    xs = act[..., :inner].reshape(b, t, s.heads, s.head_dim)
    Bm = act[..., inner:inner + gn].reshape(b, t, s.groups, s.state)
    Cm = act[..., inner + gn:].reshape(b, t, s.groups, s.state)
    dt_soft = F.softplus(dt_raw + W["mixer.dt_bias"])
    dt = dt_soft.clamp(min=s.dt_min)
    A = -torch.exp(W["mixer.A_log"])
    per_group = s.heads // s.groups
    state = torch.zeros(b, s.heads, s.head_dim, s.state, dtype=torch.float64)
    y = torch.zeros(b, t, s.heads, s.head_dim, dtype=torch.float64)
    for i in range(t):
        for h in range(s.heads):
            g = h // per_group
            decay = torch.exp(dt[:, i, h] * A[h])  # [b]
            upd = (dt[:, i, h, None] * xs[:, i, h])[:, :, None] * Bm[:, i, g][:, None, :]  # [b, p, n]
            state[:, h] = state[:, h] * decay[:, None, None] + upd
            y[:, i, h] = torch.einsum("bpn,bn->bp", state[:, h], Cm[:, i, g]) + W["mixer.D"][h] * xs[:, i, h]
    y = y.reshape(b, t, inner) * F.silu(z)
    yg = y.reshape(b, t, s.groups, inner // s.groups)
    yg = yg / torch.sqrt(yg.pow(2).mean(-1, keepdim=True) + s.eps)
    y = yg.reshape(b, t, inner) * W["mixer.norm.weight"]
    out = xd + y @ W["mixer.out_proj.weight"].T
    pre = torch.cat([torch.zeros(b, K - 1, conv_dim, dtype=torch.float64), xbc], dim=1)
    conv_state = pre[:, -(K - 1):].transpose(1, 2)
    clamped = (dt_soft < s.dt_min).double().mean().item()
    return out, (conv_state, state), clamped


@pytest.mark.parametrize("chunk,conv_bias,dt_min", [(4, True, 0.02), (3, True, 0.02), (16, False, 0.0), (1, True, 0.0)])
def test_mamba2_block_matches_naive_recurrence(chunk, conv_bias, dt_min):
    spec = Mamba2(H, heads=4, head_dim=8, state=8, groups=2, conv=4, chunk=chunk, conv_bias=conv_bias,
                  dt_min=dt_min)
    prog = ir.assemble(Embed(VOCAB, H), [spec], Norm(H), LMHead(VOCAB, H))
    random_weights(prog, seed=11, std=0.3)
    _perturb(prog, 11)
    g = torch.Generator().manual_seed(12)
    prog.weights.set("backbone.layers.0.mixer.dt_bias", torch.randn(4, generator=g) * 0.5 - 3.0)
    prog.weights.set("backbone.layers.0.mixer.A_log", torch.log(torch.tensor([0.5, 1.0, 2.0, 4.0])))
    m = materialize(prog)
    blk = m.get_submodule("backbone.layers.0")
    w = prog.node_weights(prog.node("backbone.layers.0"))
    x = torch.randn(2, T, H, generator=g)
    want, (conv_want, ssm_want), clamped = _mamba_oracle(w, spec, x)
    if dt_min:
        assert 0.0 < clamped < 1.0, "the test should exercise the dt_min clamp on some, not all, steps"
    with torch.no_grad():
        got, (conv_got, ssm_got) = blk(x, None, False)
        assert (want - x.double()).abs().max() > 0.1
        assert _rel(got.double(), want) < TOL
        assert _rel(conv_got.double(), conv_want) < TOL
        assert _rel(ssm_got.double(), ssm_want) < TOL
        # the recurrent decode path of the same block agrees with the oracle too
        outs, st = [], None
        for i in range(T):
            if i == 0:
                o, st = blk(x[:, :1], None, False)
            else:
                o, st = blk(x[:, i:i + 1], st, True)
            outs.append(o)
        assert _rel(torch.cat(outs, 1).double(), want) < TOL
        assert _rel(st[1].double(), ssm_want) < TOL
