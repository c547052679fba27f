"""puzzlekit against transformers' own NemotronH on the same weights: prefill, a training step and decode.

One random transformers `NemotronHForCausalLM` per shape, pattern MEME*E, hidden 256, at Nemotron-3's expert
counts with scaled widths: Nano (128 routed experts, 6 per token) and Super (512 experts, 22 per token, latent
experts). puzzlekit loads the checkpoint transformers saved; both run side by side in one process, first with one
thread, then with all of them. Every figure is a median of repeated calls, the two sides alternated; ratios are
puzzlekit / transformers (below 1: puzzlekit is faster). Logits are checked equal (1e-4 relative) and greedy
tokens against transformers' forward before anything is timed. The last table times the MoE mixer alone, routed
(what puzzlekit runs) and every expert on every token (the export form), to show that its work follows top-k,
not the number of experts.

Run: python benchmarks/vs_transformers.py [--shapes nano,super] [--repeats 5] [--json FILE]
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time

import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

from puzzlekit import ir
from puzzlekit.backends.torch import materialize
from puzzlekit.backends.torch.device import cpus

PATTERN = "MEME*E"
LETTER = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
VOCAB, HIDDEN = 4096, 256
#: routed experts, chosen per token, expert d_ff, shared expert d_ff, latent (0: none): Nemotron-3's expert counts,
#: widths scaled by hidden 256 / the model's hidden (Nano 2688, Super 4096)
SHAPES = {"nano": (128, 6, 176, 352, 0), "super": (512, 22, 168, 336, 64)}
PREFILL, TRAIN, PROMPT, NEW, BATCH = 512, 512, 16, 32, 8


def config(shape: str) -> NemotronHConfig:
    experts, top_k, d_ff, shared, latent = SHAPES[shape]
    return NemotronHConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, layers_block_type=[LETTER[c] for c in PATTERN],
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=512,
        mamba_num_heads=8, mamba_head_dim=32, n_groups=2, ssm_state_size=32, conv_kernel=4, chunk_size=128,
        n_routed_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=d_ff,
        moe_shared_expert_intermediate_size=shared, moe_latent_size=latent or None, routed_scaling_factor=2.5,
        tie_word_embeddings=False, eos_token_id=-1, pad_token_id=0)


def models(shape: str, workdir: str):
    """(transformers' model, puzzlekit's module) on the same weights, float32."""
    torch.manual_seed(0)
    hf = NemotronHForCausalLM(config(shape)).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # transformers' init is tiny: give routing and logits something to decide
        for name, p in hf.named_parameters():
            if not name.endswith(("A_log", "D", "dt_bias")) and "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    hf.save_pretrained(workdir)
    ours = materialize(ir.load(workdir), inference=True)
    return hf, ours


def paired(theirs, ours, repeats: int) -> list[float]:
    """Median seconds of each, the two calls alternated (after one warm-up each), so that a slower stretch of
    the machine falls on both alike."""
    theirs(), ours()
    times = [[], []]
    for _ in range(repeats):
        for i, fn in enumerate((theirs, ours)):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def greedy(ours, prompt, new: int):
    """puzzlekit's own cached greedy decode: prefill, then one token at a time."""
    with torch.no_grad():
        (logits, *_), state = ours.prefill(prompt)
        out = [logits[:, -1].argmax(-1)]
        for _ in range(new - 1):
            (logits, *_), state = ours.decode(out[-1], state)
            out.append(logits[:, -1].argmax(-1))
    return torch.stack(out, 1)


def hf_greedy(hf, prompt, new: int):
    with torch.no_grad():
        return hf.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)[:, prompt.shape[1]:]


def train_step(model, ids, hf: bool):
    model.zero_grad(set_to_none=True)
    logits = model(ids, use_cache=False).logits if hf else model(ids)
    logits = logits[0] if isinstance(logits, tuple) else logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()


def check(hf, ours, ids, prompt) -> dict:
    """Logits equal; each token of puzzlekit's cached greedy generation is the argmax of transformers' full
    forward over the same tokens, wherever its top two logits are more than 1e-3 apart (closer, float rounding
    may pick either). The oracle is transformers' full forward; how often its own `generate` leaves that
    argmax is printed (before transformers 5.25 its cached decode clamped dt differently from its prefill)."""
    with torch.no_grad():
        want, got = hf(ids, use_cache=False).logits, ours(ids)
        got = got[0] if isinstance(got, tuple) else got
        rel = ((got - want).abs().max() / want.abs().max()).item()
        assert rel < 1e-4, f"logits differ: {rel:.2e} relative"
        mine, theirs = greedy(ours, prompt, NEW), hf_greedy(hf, prompt, NEW)
        full = hf(torch.cat([prompt, mine], 1), use_cache=False).logits[:, prompt.shape[1] - 1:-1]
        top2 = full.topk(2, -1).values
        clear = top2[..., 0] - top2[..., 1] > 1e-3
        assert torch.equal(mine[clear], full.argmax(-1)[clear]), "greedy tokens differ at a clear choice"
        own = hf(torch.cat([prompt, theirs], 1), use_cache=False).logits[:, prompt.shape[1] - 1:-1].argmax(-1)
    return {"logits_rel_diff": rel, "greedy_checked": int(clear.sum()), "greedy_tokens": mine.numel(),
            "hf_generate_off_its_forward": int((own != theirs).sum())}


def moe_mixer(ours, ids, repeats: int) -> dict:
    """The first MoE mixer alone on the prefill's hidden states: routed, and every expert (the export form)."""
    mixer = ours.get_submodule("backbone.layers.1.mixer")
    x = torch.randn(1, ids.shape[1], HIDDEN, generator=torch.Generator().manual_seed(2))
    dense = copy.deepcopy(mixer)
    dense.export_form = True
    out = {}
    with torch.no_grad():
        out["routed_ms"], out["every_expert_ms"] = (1e3 * s for s in paired(lambda: mixer(x), lambda: dense(x), repeats))
    return out


def run(shape: str, threads: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="puzzlekit-vs-hf-") as d:
        hf, ours = models(shape, d)
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(1, VOCAB, (1, PREFILL), generator=g)
        prompt = torch.randint(1, VOCAB, (BATCH, PROMPT), generator=g)
        row = {"shape": shape, "threads": threads, **check(hf, ours, ids, prompt)}
        for p in [*hf.parameters(), *ours.parameters()]:
            p.requires_grad_(True)
        with torch.no_grad():
            row["prefill"] = paired(lambda: hf(ids, use_cache=False), lambda: ours(ids), repeats)
        row["train_step"] = paired(lambda: train_step(hf, ids, True), lambda: train_step(ours, ids, False), repeats)
        row["generate"] = paired(lambda: hf_greedy(hf, prompt, NEW), lambda: greedy(ours, prompt, NEW), repeats)
        row["moe_mixer"] = moe_mixer(ours, ids, repeats)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="nano,super")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    rows = [run(s, t, args.repeats) for s in args.shapes.split(",") for t in sorted({1, cpus()})]
    print(f"{'shape':6} {'threads':>7} {'task':>11} {'transformers':>13} {'puzzlekit':>10} {'ratio':>6}")
    for r in rows:
        for task in ("prefill", "train_step", "generate"):
            hf_s, ours_s = r[task]
            print(f"{r['shape']:6} {r['threads']:7} {task:>11} {hf_s * 1e3:10.1f} ms {ours_s * 1e3:7.1f} ms "
                  f"{ours_s / hf_s:5.2f}x")
    print(f"\nlogits: largest relative difference {max(r['logits_rel_diff'] for r in rows):.1e}; greedy tokens equal "
          f"to transformers' full-forward argmax: {sum(r['greedy_checked'] for r in rows)} of "
          f"{sum(r['greedy_tokens'] for r in rows)} (the rest near ties); transformers' own generate differs from its "
          f"full forward's argmax at {sum(r['hf_generate_off_its_forward'] for r in rows)} tokens")
    print(f"\nMoE mixer alone, {PREFILL} tokens ({'routed':>8} | every expert on every token)")
    base = {r["threads"]: r for r in rows if r["shape"] == "nano"}
    for r in rows:
        experts, top_k, d_ff, _, latent = SHAPES[r["shape"]]
        m = r["moe_mixer"]
        line = (f"{r['shape']:6} {r['threads']:2} threads: {m['routed_ms']:7.2f} ms | {m['every_expert_ms']:8.2f} ms "
                f"({m['every_expert_ms'] / m['routed_ms']:.1f}x; experts / top-k = {experts / top_k:.1f})")
        b = base.get(r["threads"])
        if b is not None and b is not r:
            e0, k0, f0, _, l0 = SHAPES["nano"]
            work = top_k * d_ff * (latent or HIDDEN) / (k0 * f0 * (l0 or HIDDEN))
            line += (f"; vs nano: routed {m['routed_ms'] / b['moe_mixer']['routed_ms']:.2f}x "
                     f"(top-k work {work:.2f}x, expert count {experts / e0:.1f}x)")
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
