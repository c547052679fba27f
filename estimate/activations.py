"""Activation memory: the floats per token a block's forward keeps for its backward, and what a stage's
transient work holds.

The coefficients are fitted (non-negative least squares) to the bytes autograd saves (`saved_tensors_hooks`,
parameters excluded) when puzzlekit's own modules run on the CPU, on shapes unlike the family's; the same
measurement on other shapes checks them (`tests/test_estimate.py`, `benchmarks/estimate.py --fit` prints them
anew). The Mamba-2 scan's terms depend on its chunk: the op's own on CUDA, a shorter one on the CPU.
"""
from __future__ import annotations

#: per token, for each kind: coefficient x feature (see `_features`), floats kept for the backward
COEFFICIENTS = {
    "mamba2": (3.17, 4.98, 4.15, 6.05),  # hidden, in_proj width, heads x chunk, heads x head_dim x state / chunk
    "moe": (2.97, 3.02, 2.01, 1.26, 2.21, 1.17),  # hidden, top_k x expert input, top_k x d_ff, experts, shared d_ff,
    # latent
    "attention": (3.0, 2.0, 2.0, 0.008),  # hidden, query width, key/value width, query heads x sequence
    "mlp": (3.0, 2.0),  # hidden, d_ff
    "linear": (3.0,),  # hidden
    "noop": (),
}


def chunk_of(op, device: str) -> int:
    """The Mamba-2 scan's chunk as ir/ops/mamba2.py picks it on this kind of device."""
    from ..ir.ops.mamba2 import cpu_chunk

    return op.chunk if device == "gpu" else min(op.chunk, cpu_chunk(op.state))


def _features(op, seq: int, device: str) -> tuple:
    if op.kind == "mamba2":
        L = min(chunk_of(op, device), seq)
        return (op.hidden, op.inner + op.conv_dim + op.heads, op.heads * L, op.heads * op.head_dim * op.state / L)
    if op.kind == "moe":
        return (op.hidden, op.top_k * (op.latent or op.hidden), op.top_k * op.d_ff, op.experts, op.shared_d_ff,
                op.latent)
    if op.kind == "attention":
        return (op.hidden, op.q_heads * op.head_dim, op.kv_heads * op.head_dim, op.q_heads * seq)
    if op.kind == "mlp":
        return (op.hidden, op.d_ff)
    if op.kind == "linear":
        return (op.hidden,)
    return ()


def saved_floats(op, seq: int, device: str = "cpu") -> float:
    """Floats per token a block (or an MTP head: its blocks and its fusion) keeps for the backward."""
    if op.kind == "mtp":
        return 4 * op.hidden + sum(saved_floats(b, seq, device) for b in op.blocks)
    if op.kind not in COEFFICIENTS:
        raise KeyError(f"no activation model for blocks of kind {op.kind!r}")
    return sum(c * f for c, f in zip(COEFFICIENTS[op.kind], _features(op, seq, device)))


def saved_bytes(op, rows: int, seq: int, device: str = "cpu") -> float:
    """Bytes a block keeps for the backward over rows x seq tokens (float32: the scan and the losses are float32;
    on a GPU the bf16 parts make this an upper bound)."""
    return 4 * rows * seq * saved_floats(op, seq, device)


#: float32 [chunk, vocab] tensors alive at once in a chunk of a loss over the vocabulary (evaluation.vocab), its
#: backward's recomputation: the teacher's and the student's logits, their scaled and log-softmax forms, the
#: teacher's probabilities, their difference and product, the gradient (measured: 7.4 for the KL term at a
#: 131,072-token vocabulary over 2,048 and 256 tokens in chunks of 512; the evaluation's scores 7.0, the
#: cross-entropy 3.5)
CHUNK_COPIES = 7.5


def logits_bytes(vocab: int, rows: int, seq: int, copies: float = CHUNK_COPIES) -> float:
    """The float32 logits alive at once over rows x seq tokens: `copies` [chunk, vocab] tensors, a chunk at most
    `evaluation.vocab.CHUNK_BYTES` of logits (the losses and scores never build them whole)."""
    from ..evaluation.vocab import CHUNK_BYTES

    return copies * min(4.0 * rows * seq * vocab, CHUNK_BYTES)
