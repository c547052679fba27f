"""Optimizers whose state fits a large student on one node, and what each costs.

`StochasticAdamW` (`adamw-bf16`): torch.optim.AdamW's update computed in float32, its two moments held in
bfloat16, and a bfloat16 parameter given the float32 result rounded stochastically (rounding to nearest
would drop every update below half a bfloat16 step, most of them late in a run). The rounding noise is a
hash of (seed, step, parameter, element index in the whole tensor), not a generator's stream: it is the same
whatever the sharding, and a resumed run replays it from the checkpointed step alone.

`adamw_8bit` (`adamw-8bit`): torchao's `AdamW8bit` (moments in 8 bits with a float32 scale per block of 256),
its stochastic rounding of bfloat16 parameters seeded by (seed, step, parameter, process) so that a resumed
run replays it, and run eagerly where no GPU is (its compiled kernel takes ~10 s per tensor shape to build).

`state_bytes` gives the bytes per parameter each configuration holds on the device and in host memory.
"""
from __future__ import annotations

import math

import torch

from .ranks import _local, _world

#: the optimizers `build` makes, by name
ALGORITHMS = ("adamw", "adamw-bf16", "adamw-8bit")
BETAS = (0.9, 0.95)
_M32 = 0xFFFFFFFF


class MissingDependency(ImportError):
    """An optional package an optimizer needs is not installed."""


# -- what a configuration costs ---------------------------------------------------------------------------------
#: bytes per parameter of the two moments: float32, bfloat16, 8-bit codes + a float32 scale per 256 (torchao)
MOMENT_BYTES = {"adamw": 8.0, "adamw-bf16": 4.0, "adamw-8bit": 2.0 + 2 * 4 / 256}
PARAM_BYTES = {"fp32": 4.0, "bf16": 2.0}


def state_bytes(params: str = "fp32", optimizer: str = "adamw", offload: bool = False, best: str = "host",
                shards: int = 1) -> dict[str, float]:
    """Bytes per trained parameter that one process holds between steps: {"device": ..., "host": ...}.

    `params` ("fp32" | "bf16"): the parameter's dtype, and so its gradient's; `optimizer` ("adamw",
    "adamw-bf16", "adamw-8bit"; the distill names "adamw-cosine" = "adamw"); `offload`: FSDP2's
    CPUOffloadPolicy keeps parameters, gradients and moments in host memory; `best` ("host" | "disk"):
    where the kept best weights (one copy of the parameters) live; `shards`: the processes FSDP shards
    the state over (1: unsharded or DDP). Under params=bf16 only the blocks' parameters are bfloat16: the
    embedding, LM head, final norm and the MTP head's own fusion layers (about 1-3% of a Nemotron-3 model)
    cost state_bytes("fp32", ...). Activations, the teacher and FSDP's gathered block are not counted."""
    optimizer = {"adamw-cosine": "adamw"}.get(optimizer, optimizer)
    if params not in PARAM_BYTES or optimizer not in MOMENT_BYTES or best not in ("host", "disk") or shards < 1:
        raise ValueError(f"state_bytes: params in {tuple(PARAM_BYTES)}, optimizer in {tuple(MOMENT_BYTES)}, best "
                         f"host|disk, shards >= 1; got {params!r}, {optimizer!r}, {best!r}, {shards}")
    w = PARAM_BYTES[params]
    trained = (2 * w + MOMENT_BYTES[optimizer]) / shards  # weights + gradients + moments
    kept = w / shards if best == "host" else 0.0
    return {"device": 0.0 if offload else trained, "host": kept + (trained if offload else 0.0)}


# -- building one -----------------------------------------------------------------------------------------------
def build(algorithm: str, groups: list[dict], lr: float, betas=BETAS, eps: float = 1e-8,
          seed: int = 0) -> torch.optim.Optimizer:
    """The optimizer `algorithm` names over the parameter `groups` (each with its weight_decay)."""
    if algorithm == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
    if algorithm == "adamw-bf16":
        return StochasticAdamW(groups, lr=lr, betas=betas, eps=eps, seed=seed)
    if algorithm == "adamw-8bit":
        return adamw_8bit(groups, lr=lr, betas=betas, eps=eps, seed=seed)
    raise ValueError(f"unknown optimizer algorithm {algorithm!r}; one of {', '.join(ALGORITHMS)}")


# -- stochastic rounding ------------------------------------------------------------------------------------------
def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2^32 for int64 h in [0, 2^32) without overflowing int64."""
    return ((h & 0xFFFF) * c + (((h >> 16) * c) & 0xFFFF) * 65536) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser: every output bit depends on every input bit."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _key(*parts: int) -> int:
    """A 32-bit key from small integers (MurmurHash3's finaliser in Python: no tensors for scalars)."""
    h = 0x9E3779B9
    for p in parts:
        h = (h ^ int(p)) & _M32
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & _M32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & _M32
        h ^= h >> 16
    return h


def round_bf16(x: torch.Tensor, key: int, first: int = 0) -> torch.Tensor:
    """float32 `x` (contiguous) rounded to bfloat16 stochastically: up with probability equal to the distance
    to the value below, in units of a bfloat16 step (unbiased). Element i's 16 random bits are a hash of
    (`key`, `first` + i): `first` is x's first element's index in the whole tensor."""
    idx = torch.arange(first, first + x.numel(), device=x.device, dtype=torch.int64)
    h = _fmix32((idx & _M32) ^ key ^ _mul32(idx >> 32, 0x27D4EB2F))
    bits = x.reshape(-1).view(torch.int32) + (h >> 16).to(torch.int32)  # lower 16 bits: the discarded part
    return (bits & -65536).view(torch.float32).to(torch.bfloat16).view(x.shape)


def _first_index(p: torch.Tensor) -> int:
    """The index, in the whole tensor, of this process's shard's first element (0 for a plain tensor)."""
    if not hasattr(p, "to_local"):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(shape[1:]) != tuple(p.shape[1:]) or any(offset[1:]):
        raise NotImplementedError(f"stochastic rounding of a shard split along a dimension other than the first "
                                  f"({tuple(p.shape)} -> {tuple(shape)})")
    return offset[0] * math.prod(p.shape[1:]) if p.dim() else 0


class StochasticAdamW(torch.optim.Optimizer):
    """AdamW (torch.optim.AdamW's update: decoupled weight decay, bias-corrected moments, computed in float32)
    with its moments held in `moments` (bfloat16) and bfloat16 parameters rounded stochastically (`round_bf16`);
    float32 parameters take the float32 result. With moments=float32 and float32 parameters it is
    torch.optim.AdamW. Tensors are updated `chunk` elements at a time, so the float32 temporaries stay small
    for a shard of a stacked expert tensor."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 seed: int = 0, moments: torch.dtype = torch.bfloat16, chunk: int = 1 << 22):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, seed=seed))
        self.moments, self.chunk = moments, chunk

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, which casts every state tensor to its parameter's dtype: the moments go back to theirs
        (bfloat16 -> float32 -> bfloat16 is exact)."""
        super().load_state_dict(state_dict)
        for st in self.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st and st[k].dtype != self.moments:
                    st[k] = st[k].to(self.moments)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            lr = float(lr)
            for p in group["params"]:
                index += 1  # the parameter's place in the optimizer: the same on every process and every run
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, dtype=self.moments)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moments)
                st["step"] += 1
                step = int(st["step"].item())
                bc1, bc2_sqrt = 1 - b1 ** step, (1 - b2 ** step) ** 0.5
                key = _key(group["seed"], step, index)
                w, g, m, v = (_local(t) for t in (p, p.grad, st["exp_avg"], st["exp_avg_sq"]))
                first = _first_index(p) if w.dtype == torch.bfloat16 else 0
                flat = [t.view(-1) if t.is_contiguous() else None for t in (w, g, m, v)]
                pieces = [(w, g, m, v, 0)] if None in flat or w.numel() <= self.chunk else \
                    [(*(t[i:i + self.chunk] for t in flat), i) for i in range(0, w.numel(), self.chunk)]
                for wc, gc, mc, vc, at in pieces:
                    p32, g32, m32, v32 = wc.float(), gc.float(), mc.float(), vc.float()
                    if wd:
                        p32.mul_(1 - lr * wd)
                    m32.lerp_(g32, 1 - b1)
                    v32.mul_(b2).addcmul_(g32, g32, value=1 - b2)
                    denom = (v32.sqrt() / bc2_sqrt).add_(eps)
                    p32.addcdiv_(m32, denom, value=-lr / bc1)
                    mc.copy_(m32)
                    vc.copy_(v32)
                    if wc.dtype == torch.bfloat16:
                        wc.copy_(round_bf16(p32.contiguous(), key, first + at))
                    else:
                        wc.copy_(p32)
        return loss


# -- torchao's 8-bit AdamW -----------------------------------------------------------------------------------------
_ADAMW_8BIT = None


def adamw_8bit(groups, lr: float, betas=BETAS, eps: float = 1e-8, seed: int = 0, compiled: bool | None = None):
    """torchao's AdamW8bit over `groups`, resumable (its stochastic rounding seeded per step) and eager on a
    machine without CUDA unless `compiled`."""
    global _ADAMW_8BIT
    if _ADAMW_8BIT is None:
        _ADAMW_8BIT = _resumable_8bit()
    opt = _ADAMW_8BIT(groups, lr=lr, betas=betas, eps=eps, weight_decay=0.0, bf16_stochastic_round=True)
    opt.seed, opt.compiled = seed, torch.cuda.is_available() if compiled is None else compiled
    return opt


def _resumable_8bit():
    try:
        from torchao.optim import AdamW8bit
        from torchao.optim.adam import single_param_adam
    except ImportError as e:
        raise MissingDependency(f"the 8-bit AdamW is torchao's, which is not installed ({e}); pip install "
                                "torchao") from None

    class ResumableAdamW8bit(AdamW8bit):
        """AdamW8bit whose bfloat16 stochastic rounding draws from the global generator seeded by (seed, step,
        parameter, process) inside `fork_rng` (nothing else's randomness moves); `compiled` False runs its
        update eagerly. The update is torchao's own `single_param_adam`, on each process's local shards (on
        DTensors its bfloat16 path fails in torch's sharding propagation)."""

        seed, compiled = 0, False

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            update = torch.compile(single_param_adam, fullgraph=True, dynamic=False) if self.compiled \
                else single_param_adam
            rank = _world()[0]
            devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
            index = -1
            with torch._dynamo.utils.disable_cache_limit(), torch.random.fork_rng(devices=devices):
                for group in self.param_groups:
                    if not isinstance(group["lr"], torch.Tensor):
                        group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)
                    for p in group["params"]:
                        index += 1
                        if p.grad is None:
                            continue
                        st = self.state[p]
                        if not st:
                            st["step"] = torch.tensor(0.0)
                            st["exp_avg"] = self._new_buffer(p, True)
                            st["exp_avg_sq"] = self._new_buffer(p, False)
                        st["step"] += 1
                        torch.manual_seed(_key(self.seed, int(st["step"].item()), index, rank))
                        # on this process's shards (blocks never straddle them: the state is its shard's)
                        update(_local(p.detach()), _local(p.grad), st["step"], _local(st["exp_avg"]),
                               _local(st["exp_avg_sq"]), None, group["lr"], group["betas"][0], group["betas"][1],
                               group["weight_decay"], group["eps"], True,
                               self.bf16_stochastic_round and p.dtype is torch.bfloat16)
            return loss

    return ResumableAdamW8bit
