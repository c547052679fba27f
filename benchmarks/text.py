"""Tokenized corpora: how long the standard library takes to tokenize with a byte-level BPE (the fast tokenizer's
batch path), how long the second run takes (the content-hashed cache), and the bytes per token it gives.

Run: python benchmarks/text.py [--mb 8] [--vocab 8192]
The tokenizer is trained here on the first 2 MB of the stdlib (seconds) and the corpus is the stdlib read up to
--mb MB, so the figures are the tokenizer's on text it mostly never saw. Each figure is one run in a fresh
cache directory, cold then warm, in one process with the in-memory copy cleared between them.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from puzzlekit.text import data


def train_tokenizer(d: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts, size = [], 0
    for f in data.stdlib_files():
        texts.append(f.read_text(errors="replace"))
        size += len(texts[-1])
        if size > 2_000_000:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(d)
    return d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=8.0, help="stdlib megabytes to tokenize")
    ap.add_argument("--vocab", type=int, default=8192)
    a = ap.parse_args()
    import os

    from puzzlekit.text.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["PUZZLEKIT_CACHE"] = str(Path(tmp) / "cache")
        tok = load_tokenizer(train_tokenizer(Path(tmp) / "tok", a.vocab))
        limit = int(a.mb * 1e6)
        times = []
        for _ in ("cold", "warm"):
            data._CORPORA.clear()
            start = time.perf_counter()
            c = data.load_corpus(None, limit, tokenizer=tok, progress=False)
            times.append(time.perf_counter() - start)
        tokens = len(c.train) + len(c.valid)
        nbytes = int(tok.token_bytes[c.train].sum() + tok.token_bytes[c.valid].sum())
        text_bytes = sum(len(t.encode("utf-8", errors="replace")) for _, t in data._documents([], tok, limit))
        print(f"token byte lengths sum to {nbytes:,} bytes; the documents' UTF-8 is {text_bytes:,} bytes "
              f"(relative difference {abs(nbytes - text_bytes) / text_bytes:.1e})")
        print(f"stdlib {nbytes / 1e6:.1f} MB -> {tokens:,} tokens ({nbytes / tokens:.2f} bytes/token, vocab {a.vocab})")
        print(f"tokenize (cold): {times[0]:.2f} s ({nbytes / 1e6 / times[0]:.2f} MB/s); cached (warm): {times[1]:.3f} s "
              f"({times[0] / times[1]:.0f}x)")


if __name__ == "__main__":
    main()
