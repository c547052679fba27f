"""Replace-one-block scoring: the parent with exactly one layer swapped for a variant, on held-out text.

Recorded per variant: KL(parent || candidate) of the next-token distributions (nats per token, the search's
default objective), the LM loss (nats per token) and top-1 agreement with the parent. The parent's input to
every layer and its final hidden state come from one sweep, so scoring a layer's variants runs only layers
i+1.. of the model, and all of a layer's variants go through them together: each later layer is read once
per layer scored (backends.torch.stream keeps the ones that fit the budget). The layer as the model holds it
(`None` in place of a block) is the model itself: its scores come from the sweep's final hidden state, with no
layer re-run (exactly what running it would give: KL 0, top-1 1), which halves a library's scoring when each
layer has one shrink beside its parent.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ...backends.torch import head_matrix
from ...evaluation import check_finite, vocab
from ...evaluation.vocab import Hidden


class Scorer:
    def __init__(self, stream, windows: torch.Tensor, inputs: Callable[[int], torch.Tensor], batch: int = 8):
        """`stream` a StreamedProgram of the parent; `windows` [n, T + 1] token ids; `inputs(i)` the parent's
        input to layer i on windows[:, :-1] ([n, T, hidden]), `inputs(len(blocks))` the trunk's output."""
        self.stream, self.inputs, self.batch = stream, inputs, batch
        prog = stream.program
        self.nodes = prog.blocks()
        self.tail = [prog.find("norm")[0], prog.find("lm_head")[0]]
        self.targets = windows[:, 1:].to(stream.compute.device)

    def _slices(self):
        return [slice(i, i + self.batch) for i in range(0, len(self.targets), self.batch)]

    def _run(self, block, x: torch.Tensor) -> torch.Tensor:
        with self.stream.compute.autocast():  # the model's precision; the scores in float32
            return block(x)[0]

    def _final(self, x: torch.Tensor) -> Hidden:
        """The final hidden states of `x` (the trunk's output) as flattened rows, with the LM head's matrix: the
        logits are built a chunk of tokens at a time (evaluation.vocab)."""
        norm, head = (self.stream.module(n) for n in self.tail)
        with self.stream.compute.autocast():
            h = norm(x)
        return Hidden(h, head_matrix(head), self.stream.compute.autocast).rows()

    @torch.no_grad()
    def block_outputs(self, layer: int, block, x: torch.Tensor | None = None) -> list[torch.Tensor]:
        """`block`'s output in place of layer `layer`, per batch of windows (`x`: the layer's input, read when not
        given): what `score_layer` takes in place of a block that is no longer held."""
        x = self.inputs(layer) if x is None else x
        return [self._run(block, x[s]) for s in self._slices()]

    @torch.no_grad()
    def score_layer(self, layer: int, blocks: list) -> list[dict]:
        """KL, LM loss and top-1 agreement of the parent with each of `blocks` in place of layer `layer` (`None`:
        the layer as the model holds it; a list: a block's `block_outputs`)."""
        final = self.inputs(len(self.nodes))
        run, ys = [b for b in blocks if b is not None], []
        if run:
            x = self.inputs(layer) if any(not isinstance(b, list) for b in run) else None
            ys = [list(b) if isinstance(b, list) else self.block_outputs(layer, b, x) for b in run]
            for node in self.nodes[layer + 1:]:
                m = self.stream.module(node)
                ys = [[self._run(m, y) for y in row] for row in ys]
        sums = [[0.0, 0.0, 0.0] for _ in blocks]
        for k, s in enumerate(self._slices()):
            p, targets = self._final(final[s]), self.targets[s].reshape(-1)
            ran = (row[k] for row in ys)
            for b, acc in zip(blocks, sums):
                if b is None:
                    acc[1] += vocab.nll_sum(p, targets).item()
                    acc[2] += targets.numel()
                    continue
                q = self._final(check_finite(next(ran), f"hidden states with layer {layer} replaced"))
                got = vocab.scores(p, q, targets)
                acc[0] += check_finite(got["kl"], f"KL with layer {layer} replaced").sum().item()
                acc[1] += got["nll"].sum().item()
                acc[2] += got["agree"].sum().item()
        count = self.targets.numel()
        return [{"kl": d / count, "lm_loss": lm / count, "top1": agree / count} for d, lm, agree in sums]


def sweep_inputs(stream, windows: torch.Tensor, batch: int = 8) -> Callable[[int], torch.Tensor]:
    """The parent's input to every block (and the trunk's output) on `windows`, kept from one sweep (in the
    stream's tapes: memory, then scratch files); for scorers of a model that is not built into a library."""
    blocks = stream.program.blocks()
    names = [b.args[0] for b in blocks] + [blocks[-1].name]
    kept = {}
    for _, _, kept in stream.sweep(windows, batch, keep=names):
        pass
    return lambda i: kept[names[i]].cat()
