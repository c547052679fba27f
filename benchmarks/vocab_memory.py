"""A distillation's peak memory at Nemotron-3-Super's 131,072-token vocabulary: the losses over token chunks (the
default) beside the same terms through whole logits, and each beside its `--estimate`.

The model is a miniature of Super (tools/miniature.py: its first 8 layers, MEMEMEM*, 512 experts routing 22, one
MTP layer, hidden 32) with a 131,072-row embedding and LM head, and a byte-level BPE trained on the Python
standard library whose vocabulary is padded to 131,072 (the rows are what the memory is about, not the merges).
At 8 rows of 256 tokens one float32 logits tensor is 1.07 GB; the model itself is 34 MB. Each run is a fresh
`puzzlekit run` process under /usr/bin/time -v (peak resident memory); the whole-logits run registers the built-in
terms' formulas through the whole logits (`Outputs.logits`, `Outputs.mtp`) as a plugin.

Run: python benchmarks/vocab_memory.py [--keep DIR] [--steps 2] [--batch 8] [--seq 256] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import counts  # noqa: E402
from estimate import estimated  # noqa: E402

VOCAB = 131_072

WHOLE_LOGITS = '''
"""The built-in kl and mtp terms through whole [B, T, vocab] logits: the baseline of benchmarks/vocab_memory.py."""
from puzzlekit.passes.distill import register_loss, soft_kl

register_loss("whole-kl")(lambda b: soft_kl(b.teacher.logits, b.student.logits, b.temperature))
register_loss("whole-mtp")(lambda b: soft_kl(b.teacher.mtp[:, 1:], b.student.mtp[:, 1:], b.temperature))
'''


def tokenizer(vocab: int = VOCAB):
    """A byte-level BPE (BOS <s>, EOS </s>, <pad>) trained on the standard library, its vocabulary padded with
    tokens no merge makes to `vocab` entries (plain vocabulary entries, not added tokens, which the tokenizer
    would search every text for)."""
    import json
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [p.read_text(errors="ignore") for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:150]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8192, special_tokens=["<s>", "</s>", "<pad>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    state = json.loads(tok.to_str())
    words = state["model"]["vocab"]
    words.update({f"<unused_{i}>": i for i in range(len(words), vocab)})
    tok = Tokenizer.from_str(json.dumps(state))
    assert tok.get_vocab_size() == vocab
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build(out: Path) -> Path:
    from puzzlekit.tools.miniature import build_miniature, load_config

    if not (out / "config.json").exists():
        build_miniature(load_config("nemotron-3-super-120b-a12b"), out, VOCAB, tokenizer())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keep", type=Path, help="build (and reuse) the miniature here")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--modes", nargs="+", default=["chunked", "whole"], choices=["chunked", "whole"])
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    work = a.keep or Path(tempfile.mkdtemp(prefix="vocab-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt, data = build(work / "super-131k"), work / "corpus.jsonl"
    if not data.exists():
        counts.corpus(data)
    (work / "plugins").mkdir(exist_ok=True)
    (work / "plugins" / "whole_logits.py").write_text(WHOLE_LOGITS)
    common = f"steps={a.steps},batch={a.batch},seq={a.seq},eval_every={a.steps},eval_windows=8"
    pipes = {"chunked": f"snapshot{{name=teacher}},distill{{{common}}}",
             "whole": f"snapshot{{name=teacher}},distill{{{common},kl=0,mtp=0,loss=[whole-kl,whole-mtp]}}"}
    cli = [sys.executable, "-m", "puzzlekit.tools", "run", str(ckpt), "--data", str(data), "--overwrite"]
    rows = []
    print(f"{'mode':<8} {'est. peak':>10} {'peak':>8} {'ratio':>6} {'wall':>8}")
    for mode in a.modes:
        out = work / f"out-{mode}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [*cli, "-p", pipes[mode], "-o", str(out)] + (["--plugin", "whole_logits"] if mode == "whole" else [])
        est = estimated(cmd) if mode == "chunked" else None  # the estimate counts the built-in terms' chunks
        got = counts.timed(cmd, env={"PYTHONPATH": str(work / "plugins")})
        rows.append({"mode": mode, "estimate": est, "measured": got, "command": cmd})
        if "error" in got:
            print(f"{mode:<8} failed: {got['error']}")
            continue
        e = f"{est['peak_gb']:>8.2f}GB" if est else f"{'-':>10}"
        r = f"{est['peak_gb'] / got['peak_gb']:>6.2f}" if est else f"{'-':>6}"
        print(f"{mode:<8} {e} {got['peak_gb']:>6.2f}GB {r} {got['wall_s']:>7.0f}s", flush=True)
    done = {r["mode"]: r["measured"] for r in rows if "error" not in r["measured"]}
    if len(done) == 2:
        print(f"chunked / whole: peak {done['chunked']['peak_gb'] / done['whole']['peak_gb']:.2f}x, "
              f"wall {done['chunked']['wall_s'] / done['whole']['wall_s']:.2f}x")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
