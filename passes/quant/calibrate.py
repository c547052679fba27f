"""Calibration: weight scales by amax or by an MSE search, activation amax from calibration batches."""
from __future__ import annotations

import torch

from ...ir.quant.formats import (
    FP8_MAX,
    NVFP4_BLOCK,
    FP8Tensor,
    NVFP4Tensor,
    fp8_scale,
    nvfp4_block_scale,
    nvfp4_global_scale,
    quantize_fp8,
    quantize_nvfp4,
)

#: multipliers of the amax-derived scale tried by the MSE search (below 1 clips outliers for finer steps)
MSE_RATIOS = torch.cat([torch.tensor([1.0]), torch.linspace(0.5, 1.2, 36)])  # 1.0 first: never worse than amax


def quantize_weight(w: torch.Tensor, fmt: str, method: str = "amax", name: str = "tensor") -> FP8Tensor | NVFP4Tensor:
    """Quantises one weight; `method` is "amax" (scale from the largest value) or "mse"."""
    if fmt.startswith("fp8"):
        if method == "amax":
            return quantize_fp8(w, name=name)
        base, best, err = fp8_scale(w), None, None
        for r in MSE_RATIOS:
            q = quantize_fp8(w, scale=base * r, name=name)
            e = (q.dequantize(torch.float32) - w.float()).pow(2).sum()
            if err is None or e < err:
                best, err = q, e
        return best
    if method == "amax":
        return quantize_nvfp4(w, name=name)
    # per block: try scaled block scales, keep the one with the smallest block error
    if w.shape[-1] % NVFP4_BLOCK or not bool(torch.isfinite(w).all()):
        quantize_nvfp4(w, name=name)  # raises the format's own error
    s2 = nvfp4_global_scale(w)
    blocks = w.float().reshape(*w.shape[:-1], -1, NVFP4_BLOCK)
    best_sb, best_err = None, None
    for r in MSE_RATIOS:
        sb = nvfp4_block_scale(w, s2, float(r))
        cand = quantize_nvfp4(w, block_scale=sb, global_scale=s2, name=name)
        err = (cand.dequantize(torch.float32).reshape(blocks.shape) - blocks).pow(2).sum(-1)
        if best_err is None:
            best_sb, best_err = sb, err
        else:
            better = err < best_err
            best_sb = torch.where(better, sb.view(torch.uint8), best_sb.view(torch.uint8)).view(torch.float8_e4m3fn)
            best_err = torch.minimum(err, best_err)
    return quantize_nvfp4(w, block_scale=best_sb, global_scale=s2, name=name)


def quantize_weights(ws: list[torch.Tensor], fmt: str, method: str = "amax",
                     names: list[str] | None = None) -> list[FP8Tensor | NVFP4Tensor]:
    """`quantize_weight` of each; with "amax", weights of one shape and dtype (a layer's experts) are quantised
    as one stacked batch, a scale per weight: the same values as one at a time, in a few kernels instead of a
    few per weight."""
    names = names or [f"tensor {i}" for i in range(len(ws))]
    out: list = [None] * len(ws)
    groups: dict = {}
    for i, w in enumerate(ws):
        groups.setdefault((tuple(w.shape), w.dtype), []).append(i)
    for (shape, _), idx in groups.items():
        batch = _quantize_stacked(torch.stack([ws[i] for i in idx]), fmt) if method == "amax" and len(idx) > 1 \
            else None
        for k, i in enumerate(idx):
            out[i] = batch[k] if batch is not None else quantize_weight(ws[i], fmt, method, names[i])
    return out


def _quantize_stacked(w: torch.Tensor, fmt: str) -> list | None:
    """[n, ...] -> n quantised weights, each with its own scales (None where one of them needs the single
    path's error: non-finite values, a width NVFP4 cannot block)."""
    if not w.dtype.is_floating_point:
        return None
    dims = tuple(range(1, w.dim()))
    if fmt.startswith("fp8"):
        if not bool(torch.isfinite(w).all()):
            return None
        s = fp8_scale(w, axis=0)  # [n, 1, ...]: each weight's amax / 448
        q = (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return [FP8Tensor(d.clone(), sc, w.dtype) for d, sc in zip(q.unbind(0), s.reshape(-1).float().unbind(0))]
    if w.shape[-1] % NVFP4_BLOCK:
        return None
    bamax = w.reshape(*w.shape[:-1], -1, NVFP4_BLOCK).abs().amax(-1)
    if not bool(torch.isfinite(bamax).all()):
        return None
    s2 = nvfp4_global_scale(w, bamax, dims)  # each weight's global scale
    q = quantize_nvfp4(w, block_scale=nvfp4_block_scale(w, s2, block_amax=bamax), global_scale=s2)
    # each weight its own tensors (a checkpoint holds no views of one another): one copy per weight and part
    return [NVFP4Tensor(d.clone(), b.clone(), g, w.dtype)
            for d, b, g in zip(q.data.unbind(0), q.block_scale.unbind(0), s2.reshape(-1).unbind(0))]


def input_scale(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """The static activation scale: amax / 448 for FP8, the global scale amax / (6 * 448) for NVFP4."""
    amax = torch.as_tensor(amax, dtype=torch.float32).cpu().clamp(min=1e-12)  # stored with the weights
    return (amax / FP8_MAX if fmt == "fp8" else amax / (6.0 * FP8_MAX)).reshape(())


class ActivationAmax:
    """The largest |input| seen by each module of `module_paths` (routed experts: over the tokens routed to
    them), gathered during a sweep (backends.torch.stream): `attach` hooks the modules of the node about to
    run and collects their maxima when it is done."""

    def __init__(self, module_paths: list[str]):
        self.paths = module_paths
        self.amax: dict[str, torch.Tensor] = {}

    def attach(self, node, module):
        mine = [p for p in self.paths if p.startswith(node.path + ".")]
        if not mine:
            return None
        cut = len(node.path) + 1
        hooks, mixers = [], {}
        for path in mine:
            if ".experts." in path:
                mixer_path = path.split(".experts.", 1)[0]
                mixers.setdefault(mixer_path, module.get_submodule(mixer_path[cut:]))
                continue

            def hook(m, args, path=path):
                a = args[0].detach().abs().amax().float()
                self.amax[path] = torch.maximum(self.amax.get(path, a), a)

            hooks.append(module.get_submodule(path[cut:]).register_forward_pre_hook(hook))
        for m in mixers.values():
            m.__dict__["calib"] = {}

        def finish():
            for h in hooks:
                h.remove()
            for mixer_path, m in mixers.items():
                stats = m.__dict__.pop("calib")
                for j in range(m.spec.experts):
                    for side, key in (("up", "up_proj"), ("down", "down_proj")):
                        if side in stats:
                            self.amax[f"{mixer_path}.experts.{j}.{key}"] = stats[side][j]
        return finish
