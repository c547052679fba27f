"""`ir.save` states the context the engines serve: the parent's `max_position_embeddings`, else
the window puzzlekit trained it on; the serving commands then ask for no more."""
from __future__ import annotations

import json

from puzzlekit import ir
from puzzlekit.backends.cost import get_scenario
from puzzlekit.backends.serving import serving
from puzzlekit.tools.default_model import DEFAULT_MODEL


def test_the_child_states_the_parents_context_or_its_trained_window(tmp_path):
    prog = ir.load(DEFAULT_MODEL)  # no max_position_embeddings; trained on 256-byte windows
    ir.save(prog, tmp_path / "builtin")
    assert json.loads((tmp_path / "builtin" / "config.json").read_text())["max_position_embeddings"] == 256
    s = serving(tmp_path / "builtin", tmp_path / "builtin", "tp1", get_scenario("decode-heavy"), 64)
    assert s.context_len == 256
    prog.meta["config"] = dict(prog.meta["config"], max_position_embeddings=131072)
    ir.save(prog, tmp_path / "long")
    assert json.loads((tmp_path / "long" / "config.json").read_text())["max_position_embeddings"] == 131072
    assert serving(tmp_path / "long", tmp_path / "long", "tp1", get_scenario("decode-heavy"), 64).context_len == 73728
