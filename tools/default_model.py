"""The built-in default model: a small hybrid of the Nemotron-3 shape with every block kind and an MTP head."""
from __future__ import annotations

from pathlib import Path

from ..ir import Program, assemble, load
from ..ir.ops import MLP, MTP, Attention, Embed, LMHead, Mamba2, MoE, Norm

DEFAULT_MODEL = Path(__file__).parent / "default-model"
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


def model_path(model: str | None) -> Path:
    return DEFAULT_MODEL if model in (None, "", "default") else Path(model)

