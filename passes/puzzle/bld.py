"""Blockwise local distillation (BLD): each variant learns to reproduce its parent block from the parent's
own input activations (teacher forcing), so layers train independently of each other.

The target is the block's contribution to the residual stream, `block(x) - x` (the parent's output minus
its input): the residual itself is shared by parent and child and would swamp the loss. The loss is the
normalised MSE `||d_child - d_parent||^2 / ||d_parent||^2`, reported on held-out windows.
"""
from __future__ import annotations

import copy
import zlib

import torch

from ...backends.torch import load_tensors
from ...backends.torch.device import CPU, Compute
from ...ir.ops import OpSpec, RMSNorm
from ...training import Schedule, fit


def block_module(spec: OpSpec, weights: dict) -> torch.nn.Module:
    with torch.device("meta"):  # every tensor is assigned from `weights`
        m = spec.build()
    return load_tensors(m, {k: v.detach().clone().float() for k, v in weights.items()}).float()


def nmse(block: torch.nn.Module, x: torch.Tensor, d: torch.Tensor, batch: int = 8, compute: Compute = CPU) -> float:
    """||block(x) - x - d||^2 / ||d||^2 over all windows (the block run in `compute`'s precision, the sums
    in float32)."""
    err = ref = 0.0
    with torch.no_grad():
        for xb, db in zip(x.split(batch), d.split(batch)):
            with compute.autocast():
                y = block(xb)[0]
            err += (y.float() - xb - db).pow(2).sum().item()
            ref += db.pow(2).sum().item()
    return err / max(ref, 1e-30)


def linear_fit(norm_weight: torch.Tensor, eps: float, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The `linear` replacement's matrix W minimising ||norm(x) W^T - d||^2 (ridge 1e-6 of the mean
    eigenvalue): better than the product of the parent's weights, which ignores the nonlinearity."""
    norm = RMSNorm(x.shape[-1], eps).to(x.device)  # beside the activations (the compute device)
    with torch.no_grad():
        norm.weight.copy_(norm_weight)
        a = norm(x).reshape(-1, x.shape[-1]).double()
    b = d.reshape(-1, d.shape[-1]).double()
    gram = a.T @ a
    gram += torch.eye(len(gram), dtype=gram.dtype, device=gram.device) * (1e-6 * gram.trace() / len(gram))
    return torch.linalg.solve(gram, a.T @ b).T.float()


def seed_of(*parts) -> int:
    """A stable seed per variant, so a resumed build trains it exactly as an uninterrupted one."""
    return zlib.crc32(":".join(map(str, parts)).encode())


def distill_block(block: torch.nn.Module, x: torch.Tensor, d: torch.Tensor, tokens: int, seed: int,
                  lr: float = 1e-3, batch: int = 4, compute: Compute = CPU) -> dict:
    """Trains `block` in place on (x, d) for about `tokens` tokens (AdamW, 5% warmup, cosine), its forward
    in `compute`'s precision (weights, optimizer state and the loss in float32).

    The last eighth of the windows is held back: unless training lowered the loss there by 10% (a slice
    that is already nearly exact gains nothing but noise), the starting weights are kept."""
    cut = len(x) - max(1, len(x) // 8)
    (x, hx), (d, hd) = x.split([cut, len(x) - cut]), d.split([cut, len(d) - cut])
    before = nmse(block, hx, hd, compute=compute)
    start = copy.deepcopy(block.state_dict())
    per_step = batch * x.shape[1]
    steps = max(1, -(-tokens // per_step))
    g = torch.Generator().manual_seed(seed)
    ref = d.pow(2).mean()

    def step_loss(step):
        i = torch.randint(0, len(x), (batch,), generator=g).to(x.device)
        with compute.autocast():
            y = block(x[i])[0]
        loss = (y.float() - x[i] - d[i]).pow(2).mean() / ref
        return loss, {"nmse": loss.item()}

    fit(block, step_loss, Schedule(steps=steps, lr=lr, warmup=max(1, steps // 20)), rng=g, desc="bld",
        scaler=compute.grad_scaler())
    trained = nmse(block, hx, hd, compute=compute) < 0.9 * before
    if not trained:
        block.load_state_dict(start)
    return {"steps": steps, "tokens": steps * per_step, "trained": trained}
