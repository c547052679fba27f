"""The block vocabulary. Each op kind lives in one module; adding one is a new file plus a line here."""
from .attention import Attention
from .base import Axis, Block, OpSpec, RMSNorm
from .io import Embed, LMHead, Norm
from .mamba2 import Mamba2
from .mlp import MLP, Linear, Noop
from .moe import MoE
from .mtp import MTP
from .opaque import Opaque

OPS: dict[str, type[OpSpec]] = {
    c.kind: c for c in (Embed, Norm, LMHead, Mamba2, MoE, Attention, MLP, Noop, Linear, MTP, Opaque)
}
#: Nemotron-H layer-pattern letters
LETTERS: dict[str, type[OpSpec]] = {c.letter: c for c in (Mamba2, MoE, Attention, MLP)}
LETTER_OF = {c.kind: k for k, c in LETTERS.items()}

__all__ = [
    "LETTERS",
    "LETTER_OF",
    "MLP",
    "MTP",
    "OPS",
    "Attention",
    "Axis",
    "Block",
    "Embed",
    "LMHead",
    "Linear",
    "Mamba2",
    "MoE",
    "Noop",
    "Norm",
    "OpSpec",
    "Opaque",
    "RMSNorm",
]
