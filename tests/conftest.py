"""Shared helpers for the IR tests (checkpoint, verifier, printer, rewrite).

`small_program` builds a tiny program that covers every block kind: mamba2 (chunk=4), moe with a
latent projection, moe without, attention, mlp, noop, linear, plus an MTP head with pattern "*E".
Hidden 32, vocabulary 64, random weights with std 0.3.
"""
from __future__ import annotations

import importlib
import json
import os
import platform
import sys
from pathlib import Path

import pytest
import torch

from puzzlekit import ir
from puzzlekit.ir.ops import MLP, MTP, Attention, Embed, Linear, LMHead, Mamba2, MoE, Noop, Norm

# The figures the tests assert were set with the analytic GPU prices; the measured tables (an optional extra) are
# tested where they are named (tests/test_tables.py), so a machine with or without them runs the same suite.
os.environ.setdefault("PUZZLEKIT_PRICES", "analytic")

REPOSITORY = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


class _RepositoryIsNotATestPackage:
    """The repository root is the package itself (it holds `__init__.py`): pytest would collect it as a test
    package and import that `__init__.py` a second time under the folder's name, so every module of the
    package would exist twice in one process. Collect the root as a plain directory instead."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collect_directory(self, path, parent):
        if path == REPOSITORY:
            return pytest.Dir.from_parent(parent, path=path)
        return None


def pytest_configure(config):
    config.pluginmanager.register(_RepositoryIsNotATestPackage(), "puzzlekit-repository-root")


#: the independent oracles the tests compare with; a developer without one sees its tests skipped
ORACLES = ("transformers", "modelopt.torch.quantization.qtensor", "modelopt.torch.export.quant_utils",
           "tensorrt_rtx_bindings", "datasets") + (
    ("aiconfigurator_core",) if sys.platform == "linux" and platform.machine() == "x86_64" and sys.version_info < (3, 14)
    else ())


def pytest_sessionstart(session):
    """In CI (`CI` set) a missing oracle ends the run before any test, instead of skipping what needs it."""
    if os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
        return
    for module in ORACLES:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise pytest.UsageError(f"CI: the test oracle {module} cannot be imported ({e}); install the project "
                                    "with pip install -e '.[test,tensorrt-rtx,tables]'") from e


HIDDEN = 32
VOCAB = 64


def build_small_program(weights: bool = True, seed: int = 0, dtype: torch.dtype = torch.float32) -> ir.Program:
    """A fresh small program; `weights=False` leaves the store empty (enough for printing)."""
    h = HIDDEN
    blocks = [
        Mamba2(h, heads=4, head_dim=16, state=8, groups=2, chunk=4),
        MoE(h, experts=4, top_k=2, d_ff=16, shared_d_ff=24, latent=16),
        MoE(h, experts=4, top_k=2, d_ff=16, shared_d_ff=24),
        Attention(h, q_heads=4, kv_heads=2, head_dim=8),
        MLP(h, d_ff=48),
        Noop(h),
        Linear(h),
    ]
    mtp = MTP(h, (Attention(h, 4, 2, 8), MoE(h, 4, 2, 16, 24)))
    prog = ir.assemble(Embed(VOCAB, h), blocks, Norm(h), LMHead(VOCAB, h), mtp=mtp)
    if weights:
        from puzzlekit.backends.torch import random_weights

        random_weights(prog, seed=seed, dtype=dtype, std=0.3)
    return prog


@pytest.fixture
def small_program() -> ir.Program:
    """A fresh small program with random weights (float32, std 0.3, seed 0)."""
    return build_small_program()


@pytest.fixture(scope="session")
def make_small_program():
    """The builder itself, for tests that need several programs or one without weights."""
    return build_small_program


def example_ids(batch: int = 2, length: int = 11, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g)


@pytest.fixture(scope="session")
def make_ids():
    """example_ids(batch=2, length=11, seed=1) as a fixture (test modules cannot import conftest)."""
    return example_ids


@pytest.fixture
def ids() -> torch.Tensor:
    """Token ids [2, 11] (11 is not a multiple of the Mamba chunk 4)."""
    return example_ids()


# -- a heterogeneous child of the trained default model, and its quantised forms ------------------------------------
def _shrink(prog: ir.Program, path: str, *steps) -> None:
    """Applies shrink steps (axis, kept unit indices) to one node, spec and weights together."""
    node = prog.node(path)
    spec, w = node.op, prog.node_weights(node)
    for axis, keep in steps:
        spec, w = spec.shrink(axis, keep, w)
    prog.rewrite(node, op=spec, weights=w)


def _heterogeneous_child() -> ir.Program:
    """The trained default model, pruned as Puzzle prunes: every Mamba layer to 6 heads and SSM state 24
    (uniform, as in the published child), MoE layers each with their own experts, d_ff and top-k, one
    attention layer to one KV group, the MLP's d_ff, and the MTP head's MoE top-k."""
    prog = ir.load(REPOSITORY / "tools" / "default-model")
    for n in prog.blocks("mamba2"):
        _shrink(prog, n.path, ("state", list(range(24)) + list(range(32, 56))), ("heads", [0, 1, 3, 4, 5, 7]))
    _shrink(prog, "backbone.layers.1", ("top_k", [0]), ("experts", [0, 2, 3, 5, 6, 7]))
    _shrink(prog, "backbone.layers.4", ("d_ff", list(range(0, 128, 2))))
    _shrink(prog, "backbone.layers.8", ("experts", [1, 2, 4, 7]), ("d_ff", list(range(96))))
    _shrink(prog, "backbone.layers.3", ("kv_heads", [1]))
    _shrink(prog, "backbone.layers.6", ("d_ff", list(range(192))))
    mtp = prog.node("mtp")
    prog.rewrite(mtp, op=mtp.op.replace(blocks=(mtp.op.blocks[0], mtp.op.blocks[1].replace(top_k=1))))
    ir.verify(prog)
    return prog


def _quantized_with(prog: ir.Program, recipe: str, amax=lambda module: 4.0) -> ir.Program:
    """The program with its weights quantised by a recipe: amax weight scales, and activation scales from a
    fixed amax per module (`amax(module path)`, 4 by default)."""
    from puzzlekit.ir.quant.recipe import FORMATS, get_recipe
    from puzzlekit.passes.quant.calibrate import input_scale, quantize_weight

    out = prog.copy()
    for path, params in get_recipe(recipe).assign(out).items():
        node, new = out.node(path), {}
        for local, fmt in params.items():
            new[local] = quantize_weight(out.weights.get(f"{path}.{local}"), FORMATS[fmt][0], name=local)
            if FORMATS[fmt][1]:
                module = local.rsplit(".", 1)[0]
                new[f"{module}.input_scale"] = input_scale(torch.tensor(amax(f"{path}.{module}")), FORMATS[fmt][1])
        out.rewrite(node, op=node.op.replace(quant=dict(node.op.quant) | params), weights=new)
    return out


@pytest.fixture(scope="session")
def shrink():
    """The function `_shrink(program, node path, *(axis, kept indices))`."""
    return _shrink


@pytest.fixture(scope="session")
def heterogeneous_child():
    """The builder `_heterogeneous_child()`: a fresh pruned copy of the trained default model per call."""
    return _heterogeneous_child


@pytest.fixture(scope="session")
def quantized_with():
    """The function `_quantized_with(program, recipe, amax=...)`."""
    return _quantized_with


@pytest.fixture(scope="session")
def default_bundle(tmp_path_factory):
    """The built-in model's rtx-sm120 bundle (FP32 graphs, engines built where TensorRT-RTX is installed), written
    once: the ONNX tests read its graphs and the TensorRT tests its files, so the model is exported once.
    (program, directory, report, the modules traced, the graphs stitched)."""
    import puzzlekit.backends.onnx.export as export
    from puzzlekit.backends.cost import get_scenario
    from puzzlekit.backends.targets import TARGETS
    from puzzlekit.backends.tensorrt import write_bundle
    from puzzlekit.tools.default_model import DEFAULT_MODEL, load_default

    traced, stitched = [], []
    real_export, real_optimize = export._export, export._optimize
    out, prog = tmp_path_factory.mktemp("bundle") / "rtx-sm120", load_default()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export, "_export", lambda module, *a: traced.append(module) or real_export(module, *a))
        mp.setattr(export, "_optimize", lambda model: stitched.append(model) or real_optimize(model))
        # short prompts: one prefill profile, so that the real build in the default suite stays quick
        report = write_bundle(prog, out, TARGETS["rtx-sm120"], get_scenario("chat", input_len=256, output_len=256),
                              build="auto", checkpoint=DEFAULT_MODEL)  # and the commands serving it (test_serving.py)
    return prog, out, report, traced, stitched


SMALL_GRID = """
[mamba2]
heads = [0.5]
[moe]
experts = [1.0, 0.5]
top_k = [1.0, 0.5]
[attention]
q_heads = [0.5]
[mlp]
d_ff = [0.5]
[replacements]
kinds = ["noop", "linear"]
"""


@pytest.fixture(scope="session")
def small_grid_file(tmp_path_factory):
    """A reduced Puzzle grid (3-5 variants per layer)."""
    f = tmp_path_factory.mktemp("grid") / "small.toml"
    f.write_text(SMALL_GRID)
    return f


@pytest.fixture(scope="session")
def small_library(small_grid_file, tmp_path_factory):
    """The built-in model's block library on the small grid with small budgets, built once per session."""
    from puzzlekit.passes.puzzle import LibrarySettings, build_library
    from puzzlekit.tools.default_model import model_path

    settings = LibrarySettings(calib_windows=8, score_windows=2, seq=64, bld_tokens=4096)
    return build_library(ir.load(model_path(None)), tmp_path_factory.mktemp("lib") / "lib", small_grid_file, settings)


def _engine_layer_config(cfg: dict, block: dict) -> dict:
    """vLLM's get_nemotron_h_config_for_layer: the top level without every field any block overrides,
    updated with this block's fields."""
    blocks = cfg["block_configs"] + cfg["mtp_block_configs"]
    overridden = {k for b in blocks for k, v in b.items() if v is not None}
    out = {k: v for k, v in cfg.items() if k not in overridden | {"block_configs", "mtp_block_configs"}}
    out.update({k: v for k, v in block.items() if v is not None})
    return out


def _served_layers(cfg: dict) -> list[tuple[str, dict, object]]:
    """(tensor prefix, block config, transformers' NemotronHBlock) of every layer, trunk and MTP head, each built from its
    config the way vLLM builds it: the independent oracle of what a serving engine makes of a checkpoint."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.nemotron_h import modeling_nemotron_h as hfm

    cfg = transformers.PretrainedConfig._decode_special_floats(cfg)  # as transformers reads a config.json
    layers = [(f"backbone.layers.{i}.", b, i, cfg["layers_block_type"]) for i, b in enumerate(cfg["block_configs"])]
    layers += [(f"mtp.layers.{i}.", b, i, cfg["mtp_layers_block_type"]) for i, b in enumerate(cfg["mtp_block_configs"])]
    out = []
    for prefix, block, idx, types in layers:
        hf_cfg = transformers.NemotronHConfig.from_dict(_engine_layer_config(cfg, block) | {"layers_block_type": types})
        out.append((prefix, block, hfm.NemotronHBlock(hf_cfg, layer_idx=idx).float().eval()))
    return out


@pytest.fixture(scope="session")
def served_layers():
    """The function `_served_layers(config dict)`: every layer as a serving engine builds it."""
    return _served_layers


def _shapes(op) -> dict:
    """A block's parameter shapes under transformers' names (routed experts stacked)."""
    out, experts = {}, {}
    for name, shape in op.params().items():
        parts = name.split(".")
        if parts[:2] == ["mixer", "experts"]:
            experts.setdefault(f"mixer.experts.{parts[3]}", []).append(tuple(shape))
        else:
            out[name] = tuple(shape)
    return out | {k: (len(v), *v[0]) for k, v in experts.items()}


def _assert_served(prog: ir.Program, cfg: dict) -> None:
    """Every layer of `prog`, as an engine builds it from the config `cfg` it was saved with, has the program's
    parameter shapes."""
    mtp = prog.find("mtp")
    ours = {f"backbone.layers.{i}.": n.op for i, n in enumerate(prog.blocks())} | \
        {f"mtp.layers.{i}.": b for i, b in enumerate(mtp[0].op.blocks if mtp else ())}
    built = _served_layers(cfg)
    assert len(built) == len(ours)
    for prefix, _, blk in built:
        assert {k: tuple(p.shape) for k, p in blk.state_dict().items()} == _shapes(ours[prefix]), prefix


@pytest.fixture(scope="session")
def assert_served():
    """The function `_assert_served(program, saved config dict)`."""
    return _assert_served


# -- a subword model: a BPE tokenizer trained here and a transformers NemotronH in its vocabulary ----------------
SUBWORD_VOCAB = 1024
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _stdlib_texts(limit: int, skip: int = 0) -> list[str]:
    from puzzlekit.text.data import stdlib_files

    out, size = [], 0
    for f in stdlib_files()[skip:]:
        t = f.read_text(errors="replace")
        out.append(t)
        size += len(t)
        if size >= limit:
            break
    return out


def _train_tokenizer(d: Path):
    """A byte-level BPE (as Nemotron-3's) with BOS <s> added by its post-processor, EOS </s>, a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SUBWORD_VOCAB, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_stdlib_texts(400_000), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(d)
    return fast


def _subword_checkpoint(d: Path, tokenizer):
    """transformers' NemotronH (pattern MEM*E, hidden 32) in the tokenizer's vocabulary, O(0.3) weights, plus an
    MTP head ("*E") in its checkpoint as Nemotron-3 ships one."""
    from safetensors.torch import load_file, save_file
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from puzzlekit.tools.miniature import seeded_init

    letters = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
    cfg = NemotronHConfig(
        vocab_size=SUBWORD_VOCAB, hidden_size=HIDDEN, layers_block_type=[letters[c] for c in "MEM*E"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4,
        mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=16, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
        routed_scaling_factor=2.0, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = NemotronHForCausalLM(cfg).float().eval()
    g = seeded_init(model, 1, std=0.3)
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    eps = cfg.layer_norm_epsilon
    spec = MTP(HIDDEN, (Attention(HIDDEN, 4, 2, 8, eps), MoE(HIDDEN, 4, 2, 16, 24, scaling=2.0, norm_topk=True, eps=eps)),
               eps)
    tensors = load_file(str(d / "model.safetensors"))
    for k, shape in spec.params().items():
        std = 0.05 if k.endswith("e_score_correction_bias") else 0.3
        t = std * torch.randn(shape, generator=g)
        tensors[f"mtp.{k}"] = (1 + t / 3 if k.endswith("norm.weight") else t).contiguous()
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1,
                                                        "mtp_hybrid_override_pattern": "*E"}, indent=2))
    return model


def _documents_jsonl(f: Path, n: int = 150) -> Path:
    """`n` JSONL documents of Python source (stdlib files the tokenizer was not trained on), 300-1500 chars."""

    texts = [t[:1500] for t in _stdlib_texts(10**9, skip=400) if len(t) > 300][:n]
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return f


@pytest.fixture(scope="session")
def subword(tmp_path_factory):
    """A namespace: `model` (checkpoint directory with the tokenizer beside it), `hf` (transformers' model),
    `tokenizer` (transformers'), `tokenizer_dir` (the tokenizer alone), `docs` (a JSONL file of 150 documents)."""
    from types import SimpleNamespace

    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("subword")
    tokenizer = _train_tokenizer(root / "tokenizer")
    hf = _subword_checkpoint(root / "model", tokenizer)
    return SimpleNamespace(model=root / "model", hf=hf, tokenizer=tokenizer, tokenizer_dir=root / "tokenizer",
                           docs=_documents_jsonl(root / "docs.jsonl"))


# -- lm-evaluation-harness tasks that read their data from disk ----------------------------------------------------
def _source_lines() -> list[str]:
    """Source lines of 30+ characters from the first stdlib files that hold 200 of them (the same on any machine
    with the same Python)."""
    from puzzlekit.text.data import stdlib_files

    out = []
    for f in stdlib_files():
        out += [ln.strip() for ln in f.read_text(errors="replace").splitlines() if len(ln.strip()) > 30]
        if len(out) >= 200:
            return out
    return out


def _write_tasks(d: Path) -> Path:
    """Three lm-eval tasks in `d` reading data on disk, on Python source lines: pk_mc (multiple choice: the
    line's true second half among three others), pk_ppl (rolling log-likelihood of 6-line passages), pk_gen
    (greedy, stopped at a newline)."""
    lines = _source_lines()
    mc = []
    for i in range(12):
        line = lines[i * 3]
        cut = len(line) // 2
        choices = [line[cut:]] + [other[len(other) // 2:] for other in lines[100 + i * 3:103 + i * 3]]
        order = [(i + j) % 4 for j in range(4)]
        mc.append({"question": line[:cut], "choices": [choices[o] for o in order], "answer": order.index(0)})
    files = {"mc": mc, "ppl": [{"text": "\n".join(lines[i * 6:i * 6 + 6])} for i in range(4)],
             "gen": [{"prompt": lines[i * 5 + 1][:24] + "\n" + lines[i * 5 + 2][:10],
                      "target": lines[i * 5 + 2][10:]} for i in range(5)]}
    for name, rows in files.items():
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def task(name, body):
        (d / f"pk_{name}.yaml").write_text(f"task: pk_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                           f"    test: {d / (name + '.jsonl')}\ntest_split: test\n{body}")

    task("mc", 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
               'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n')
    task("ppl", 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                'metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n')
    task("gen", 'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
                'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 12\n  do_sample: false\n'
                'metric_list:\n  - metric: exact_match\n')
    return d


@pytest.fixture(scope="session")
def local_tasks(tmp_path_factory) -> Path:
    """A folder of three lm-eval task YAMLs reading JSONL files beside them (see `_write_tasks`)."""
    return _write_tasks(tmp_path_factory.mktemp("tasks"))
