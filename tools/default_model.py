"""The built-in default model: a small hybrid of the Nemotron-3 shape with every block kind and an MTP head."""
from __future__ import annotations

from pathlib import Path

from ..ir import Program, assemble, load
from ..ir.ops import MLP, MTP, Attention, Embed, LMHead, Mamba2, MoE, Norm

DEFAULT_MODEL = Path(__file__).parent / "default-model"
#: the public architecture configs shipped with the package (meta weights: load, print, cost, plan)
CONFIGS = Path(__file__).parent / "configs"
PATTERN = "MEM*EM-MEM*E"


def default_architecture(vocab: int = 256, hidden: int = 128) -> Program:
    """Byte-level vocabulary; MoE with a shared expert and a latent projection; MTP pattern `*E`."""
    kinds = {
        "M": Mamba2(hidden, heads=8, head_dim=32, state=32, groups=2, chunk=32),
        "E": MoE(hidden, experts=8, top_k=2, d_ff=128, shared_d_ff=128, latent=64, scaling=2.0),
        "*": Attention(hidden, q_heads=4, kv_heads=2, head_dim=32),
        "-": MLP(hidden, d_ff=256),
    }
    mtp = MTP(hidden, (kinds["*"], kinds["E"]))
    return assemble(Embed(vocab, hidden), [kinds[c] for c in PATTERN], Norm(hidden), LMHead(vocab, hidden), mtp,
                    meta={"dtype": "float32"})


def load_default() -> Program:
    return load(DEFAULT_MODEL)


def config_path(name: str) -> Path:
    """A shipped config by name, e.g. `nemotron-3-super-120b-a12b`."""
    return CONFIGS / f"{name}.config.json"


def model_path(model: str | None) -> Path:
    """What a command's MODEL argument names: the built-in model (none or `default`), a shipped config's
    name, a path, or a hub id (`owner/name`, from the local hub cache or downloaded; see hub.py)."""
    if model in (None, "", "default"):
        return DEFAULT_MODEL
    if "/" not in model and not Path(model).exists() and config_path(model).is_file():
        return config_path(model)
    from ..text.hub import resolve

    return resolve(model, "model")

