"""Replace-one-block scoring: the parent with exactly one layer swapped for a variant, on held-out text.

Recorded per variant: KL(parent || candidate) of the next-token distributions (nats per token, the search's
default objective), the LM loss (nats per token) and top-1 agreement with the parent. The parent's
inputs to every layer and its log-probabilities are computed once, so scoring a variant of layer i runs
only layers i.. of the model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...evaluate import check_finite


class Scorer:
    def __init__(self, model, windows: torch.Tensor, inputs: list[torch.Tensor], batch: int = 8):
        """`windows` [n, T + 1] token ids; `inputs[i]` the parent's input to layer i on windows[:, :-1]."""
        self.model, self.batch = model, batch
        self.blocks = [model.get_submodule(n.path) for n in model.program.blocks()]
        self.norm = model.get_submodule(model.program.find("norm")[0].path)
        self.head = model.get_submodule(model.program.find("lm_head")[0].path)
        self.targets = windows[:, 1:].to(model.compute.device)
        self.inputs = inputs
        with torch.no_grad():
            self.parent = [F.log_softmax(self._logits(0, self.blocks[0], s), -1) for s in self._slices()]

    def _slices(self):
        return [slice(i, i + self.batch) for i in range(0, len(self.targets), self.batch)]

    def _logits(self, layer: int, block, rows: slice) -> torch.Tensor:
        with self.model.compute.autocast():  # the model's precision; the scores in float32
            x = block(self.inputs[layer][rows])[0]
            for b in self.blocks[layer + 1:]:
                x = b(x)[0]
            return self.head(self.norm(x)).float()

    @torch.no_grad()
    def score(self, layer: int, block) -> dict:
        """KL, LM loss and top-1 agreement of the parent with `block` in place of layer `layer`."""
        kl = lm = agree = 0.0
        count = self.targets.numel()
        for rows, p in zip(self._slices(), self.parent):
            q = F.log_softmax(check_finite(self._logits(layer, block, rows), f"logits with layer {layer} replaced"), -1)
            kl += (p.exp() * (p - q)).sum().item()
            lm += F.nll_loss(q.reshape(-1, q.shape[-1]), self.targets[rows].reshape(-1), reduction="sum").item()
            agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
        return {"kl": kl / count, "lm_loss": lm / count, "top1": agree / count}
