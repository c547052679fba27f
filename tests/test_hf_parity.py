"""Parity with transformers' NemotronH: checkpoints saved by transformers load, verify and run to the same
logits; an MTP head added to such a checkpoint matches an oracle built from transformers' own modules; and
tracing the transformers model gives the same Program as loading its checkpoint."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import NemotronHConfig, NemotronHForCausalLM  # noqa: E402
from transformers.models.nemotron_h import modeling_nemotron_h as hfm  # noqa: E402

import puzzlekit  # noqa: E402
from puzzlekit import ir  # noqa: E402
from puzzlekit.backends.torch import checkpoint_state, materialize  # noqa: E402
from puzzlekit.ir.ops import MTP, Attention, MoE  # noqa: E402

VOCAB, H = 64, 32
PATTERN = "ME*-ME"
LETTER = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
TOL = 1e-5  # relative to the magnitudes compared (see _rel)


def _rel(got, want) -> float:
    """Largest difference relative to the magnitude of `want` (at least 1): fp32 results differ between CPUs."""
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())
VARIANTS = {"plain": None, "latent": 16}


def _config(latent, pattern=PATTERN) -> NemotronHConfig:
    return NemotronHConfig(
        vocab_size=VOCAB, hidden_size=H, layers_block_type=[LETTER[c] for c in pattern],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4,
        chunk_size=4,  # smaller than the sequences below: several chunks plus padding
        time_step_limit=(0.01, float("inf")),  # dt's clamp: active on some steps with the dt_bias below
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=24, moe_latent_size=latent, routed_scaling_factor=2.0,
        tie_word_embeddings=False,
    )


def _reinit(module: torch.nn.Module, seed: int) -> None:
    """transformers' init is tiny (std 0.02): make every tensor O(0.3) so logits differ meaningfully."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.copy_(torch.log(torch.arange(1, p.numel() + 1, dtype=torch.float32)))
            elif leaf == "D":
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif leaf == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 - 3.0)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif leaf == "e_score_correction_bias":
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


def _ids(b, t, seed):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(VARIANTS))
def ckpt(request, tmp_path_factory):
    """(variant, checkpoint dir, transformers model in fp32) for a tiny random NemotronH."""
    latent = VARIANTS[request.param]
    torch.manual_seed(0)
    model = NemotronHForCausalLM(_config(latent)).float().eval()
    _reinit(model, seed=1)
    d = tmp_path_factory.mktemp(f"hf_{request.param}")
    model.save_pretrained(d)
    return request.param, d, model


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


# -- load + verify + logits ------------------------------------------------------------------------------------
@pytest.mark.parametrize("b,t", [(2, 11), (2, 8), (1, 1)])
def test_loaded_checkpoint_matches_transformers(ckpt, b, t):
    variant, d, model = ckpt
    prog = ir.load(d)
    ir.verify(prog)
    assert [n.op.kind for n in prog.blocks()] == ["mamba2", "moe", "attention", "mlp", "mamba2", "moe"]
    assert prog.find("mtp") == [] and prog.outputs == ("logits",)
    mamba = prog.blocks("mamba2")[0].op
    assert mamba.chunk == 4 and mamba.dt_min == pytest.approx(0.01)
    moe = prog.blocks("moe")[0].op
    assert moe.latent == (VARIANTS[variant] or 0) and moe.scaling == 2.0 and moe.shared_d_ff == 24
    if VARIANTS[variant]:
        assert "backbone.layers.1.mixer.fc1_latent_proj.weight" in prog.weights
    m = materialize(prog)
    ids = _ids(b, t, seed=10 + t)
    with torch.no_grad():
        ours = m(ids)
    want = _hf_logits(model, ids)
    assert ours.shape == want.shape == (b, t, VOCAB)
    assert want.abs().max() > 0.1
    assert _rel(ours, want) < TOL


def test_loaded_weights_are_transformers_weights(ckpt):
    """Every tensor of the model reaches the Program (experts unstacked, one per expert), with the same values,
    and the module holds the routed experts stacked under transformers' own names."""
    _, d, model = ckpt
    prog = ir.load(d)
    module = materialize(prog)
    ours, stacked = checkpoint_state(module), module.state_dict()
    n = 0
    for name, t in model.state_dict().items():
        key = name.replace("model.", "backbone.", 1) if name.startswith("model.") else name
        assert torch.equal(stacked[key], t), key
        if key.endswith(("mixer.experts.up_proj", "mixer.experts.down_proj")):
            base, leaf = key.rsplit(".", 1)
            for j in range(t.shape[0]):
                assert torch.equal(prog.weights.get(f"{base}.{j}.{leaf}.weight"), t[j]), key
                assert torch.equal(ours[f"{base}.{j}.{leaf}.weight"], t[j]), key
                n += 1
        else:
            assert torch.equal(ours[key], t), key
            n += 1
    assert n == len(ours) == len(prog.weights) and len(stacked) == len(model.state_dict())


# -- MTP ---------------------------------------------------------------------------------------------------------
def _mtp_spec(latent) -> MTP:
    eps = _config(latent).layer_norm_epsilon
    return MTP(H, (Attention(H, 4, 2, 8, eps),
                   MoE(H, 4, 2, 16, 24, latent=latent or 0, scaling=2.0, norm_topk=True, eps=eps)), eps)


def _mtp_weights(spec: MTP, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, shape in spec.params().items():
        if k.endswith("norm.weight"):
            t = 1 + 0.1 * torch.randn(shape, generator=g)
        elif k.endswith("e_score_correction_bias"):
            t = 0.05 * torch.randn(shape, generator=g)
        else:
            t = 0.3 * torch.randn(shape, generator=g)
        out[k] = t.float().contiguous()
    return out


@pytest.fixture(scope="module")
def mtp_ckpt(ckpt, tmp_path_factory):
    """The checkpoint above plus mtp.* tensors and num_nextn_predict_layers=1, pattern "*E"."""
    variant, d, model = ckpt
    latent = VARIANTS[variant]
    spec = _mtp_spec(latent)
    mw = _mtp_weights(spec, seed=2)
    out = tmp_path_factory.mktemp(f"hf_mtp_{variant}")
    tensors = load_file(str(d / "model.safetensors"))
    assert not any(k.startswith("mtp.") for k in tensors)
    tensors.update({f"mtp.{k}": v for k, v in mw.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    cfg["mtp_hybrid_override_pattern"] = "*E"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in d.iterdir():  # generation config and the like
        if not (out / f.name).exists():
            (out / f.name).write_bytes(f.read_bytes())
    return variant, out, model, spec, mw


def test_transformers_still_loads_mtp_checkpoint(mtp_ckpt):
    variant, d, model, _, _ = mtp_ckpt
    hf2 = NemotronHForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert hf2.config.num_nextn_predict_layers == 1
    ids = _ids(2, 11, seed=3)
    assert (_hf_logits(hf2, ids) - _hf_logits(model, ids)).abs().max().item() == 0.0


def test_load_keeps_mtp_weights(mtp_ckpt):
    _, d, _, spec, mw = mtp_ckpt
    prog = ir.load(d)
    ir.verify(prog)
    assert prog.outputs == ("logits", "mtp_logits")
    node = prog.node("mtp")
    assert node.op == spec and node.op.pattern == "*E"
    assert node.args == (prog.blocks()[-1].name, "input_ids")
    for k, t in mw.items():
        assert torch.equal(prog.weights.get(f"mtp.{k}"), t), k
    assert "mtp" in ir.print_program(prog)


def _mtp_oracle(model, cfg_latent, mw: dict, ids: torch.Tensor) -> torch.Tensor:
    """The Nemotron MTP head from transformers' own modules: NemotronHRMSNorm for enorm/hnorm/final norm,
    NemotronHBlock for the attention and MoE layers (experts stacked as transformers stores them)."""
    eps = model.config.layer_norm_epsilon
    mcfg = _config(cfg_latent, pattern="*E")
    captured = {}

    def grab(mod, args):
        captured["h"] = args[0].detach().clone()

    hook = model.model.norm_f.register_forward_pre_hook(grab)
    try:
        trunk = _hf_logits(model, ids)
    finally:
        hook.remove()
    h = captured["h"]  # trunk hidden states before the final norm

    def norm(key):
        n = hfm.NemotronHRMSNorm(H, eps=eps)
        n.weight.data.copy_(mw[key])
        return n

    enorm, hnorm = norm("layers.0.enorm.weight"), norm("layers.0.hnorm.weight")
    final = norm("layers.1.final_layernorm.weight")
    eh_proj = torch.nn.Linear(2 * H, H, bias=False)
    eh_proj.weight.data.copy_(mw["layers.0.eh_proj.weight"])
    blocks = []
    for i in range(2):
        blk = hfm.NemotronHBlock(mcfg, layer_idx=i).float().eval()
        prefix = f"layers.{i}."
        local = {k[len(prefix):]: v for k, v in mw.items() if k.startswith(prefix)}
        for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"):
            local.pop(k, None)
        sd = {}
        for k, v in local.items():
            if k.startswith("mixer.experts."):
                continue
            sd[k] = v
        if i == 1:
            E = 4
            sd["mixer.experts.up_proj"] = torch.stack([local[f"mixer.experts.{j}.up_proj.weight"] for j in range(E)])
            sd["mixer.experts.down_proj"] = torch.stack([local[f"mixer.experts.{j}.down_proj.weight"]
                                                         for j in range(E)])
        blk.load_state_dict(sd, strict=True)
        blocks.append(blk)
    assert blocks[0].block_type == "full_attention" and blocks[1].block_type == "moe"
    b, t = ids.shape
    # an explicit additive causal mask: correct whatever attention implementation the block dispatches to
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None].expand(b, 1, t, t)
    with torch.no_grad():
        prev = torch.cat([torch.zeros(b, 1, H), h[:, :-1]], dim=1)
        z = eh_proj(torch.cat([enorm(model.model.embeddings(ids)), hnorm(prev)], dim=-1))
        z = blocks[0](z, attention_mask=causal)
        z = blocks[1](z)
        return trunk, model.lm_head(final(z))


def test_mtp_logits_match_transformers_oracle(mtp_ckpt):
    variant, d, model, _, mw = mtp_ckpt
    prog = ir.load(d)
    m = materialize(prog)
    ids = _ids(2, 11, seed=4)
    with torch.no_grad():
        logits, mtp_logits = m(ids)
    trunk, want = _mtp_oracle(model, VARIANTS[variant], mw, ids)
    assert _rel(logits, trunk) < TOL
    assert want.abs().max() > 0.1
    assert (mtp_logits - logits).abs().max().item() > 0.1  # not the trunk's logits by accident
    assert _rel(mtp_logits, want) < TOL


def test_mtp_oracle_attention_is_causal(mtp_ckpt):
    """Guards the oracle: changing the last token leaves every earlier MTP logit unchanged."""
    variant, _, model, _, mw = mtp_ckpt
    ids = _ids(1, 7, seed=5)
    ids2 = ids.clone()
    ids2[0, -1] = (ids[0, -1] + 1) % VOCAB
    _, a = _mtp_oracle(model, VARIANTS[variant], mw, ids)
    _, b = _mtp_oracle(model, VARIANTS[variant], mw, ids2)
    assert _rel(a[:, :-1], b[:, :-1]) < TOL
    assert (a[:, -1] - b[:, -1]).abs().max().item() > 1e-3


# -- tracing the transformers model ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def traced(ckpt):
    _, d, model = ckpt
    ids = _ids(2, 11, seed=6)
    return puzzlekit.trace(model, (ids,), kwargs={"use_cache": False})


def test_trace_prints_like_the_loaded_checkpoint(ckpt, traced):
    _, d, _ = ckpt
    loaded = ir.load(d)
    ir.verify(traced)
    assert ir.print_program(traced) == ir.print_program(loaded)
    assert not traced.find("opaque")


def test_trace_weights_equal_checkpoint_weights(ckpt, traced):
    _, d, _ = ckpt
    loaded = ir.load(d)
    assert sorted(traced.weights.names()) == sorted(loaded.weights.names())
    for k in loaded.weights.names():
        assert torch.equal(traced.weights.get(k), loaded.weights.get(k)), k


@pytest.mark.parametrize("b,t", [(3, 6), (1, 17), (4, 1)])
def test_traced_program_has_dynamic_shapes(ckpt, traced, b, t):
    _, _, model = ckpt
    ids = _ids(b, t, seed=7 + t)
    with torch.no_grad():
        ours = materialize(traced)(ids)
    want = _hf_logits(model, ids)
    assert ours.shape == want.shape == (b, t, VOCAB)
    assert want.abs().max() > 0.1
    assert _rel(ours, want) < TOL
