"""The files that travel with a checkpoint beside its weights: the tokenizer's and the generation config.

Every output checkpoint carries its parent's, so that the child is served, evaluated and tokenized exactly as
the parent was (engines and transformers read them from the checkpoint directory)."""
from __future__ import annotations

import shutil
from pathlib import Path

#: the files a tokenizer is read from (any of them marks a directory as holding one)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
#: every file copied with the tokenizer: its own, the special tokens, a chat template, the generation config
COMPANION_FILES = (*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")


def has_tokenizer(d: Path) -> bool:
    return any((Path(d) / f).is_file() for f in TOKENIZER_FILES)


def companions(prog) -> dict[str, Path]:
    """name -> file to copy: the tokenizer's files from the program's tokenizer directory, and the generation
    config from there or from the checkpoint the program was read from."""
    out = {}
    for key in ("source", "tokenizer"):  # the tokenizer's own files take precedence
        d = Path(prog.meta.get(key) or "")
        if not str(d) or str(d) == ".":
            continue
        d = d if d.is_dir() else d.parent
        names = ("generation_config.json",) if key == "source" else COMPANION_FILES
        out |= {n: d / n for n in names if (d / n).is_file()}
    return out


def copy_companions(prog, dst: Path) -> list[str]:
    """Copies `companions(prog)` into `dst` (links followed: a hub cache holds links); returns their names."""
    files = companions(prog)
    for name, f in files.items():
        shutil.copyfile(f, Path(dst) / name)
    return sorted(files)
