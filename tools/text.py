"""`puzzlekit train`, `eval` and `generate`: the commands that run a model on text (in its own tokenization)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

from ..outputs import check_output
from ..errors import UsageError
from .common import compute_of, emit, load_model


def train(args) -> int:
    from .train import TrainConfig
    from .train import train as run_training

    compute = compute_of(args)
    out = check_output(args.output, args.data or [], overwrite=True)
    if out.is_dir() and any(out.iterdir()) and not (out / "train_state.pt").exists():
        raise UsageError(f"{out} is not empty and holds no training run; choose a new -o "
                         "(the same -o again resumes a run)")
    cfg = TrainConfig(steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr, seed=args.seed,
                      checkpoint_every=args.checkpoint_every, max_minutes=args.max_minutes)
    tokenizer = None
    if args.tokenizer:
        from ..text.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    m = run_training(Path(args.output), cfg, args.data, progress=not args.json, compute=compute, tokenizer=tokenizer)
    text = (f"step {m['step']}/{cfg.steps} in {m['train_seconds']:.0f} s\n"
            f"validation bits per byte {m['valid_bits_per_byte']:.3f} (unigram baseline "
            f"{m['unigram_bits_per_byte']:.3f}) on {m['valid_bytes']:,} bytes ({m['valid_tokens']:,} tokens)\n"
            f"MTP top-1 accuracy {m['mtp_top1_accuracy']:.3f}\nwrote {Path(args.output) / 'model'}\n")
    emit(args, m, text)
    return 0


def _scored_text(args, corpus):
    """What `eval` scores: with --data and no --held-out, the whole file (every document, in windows that overlap by
    one token so that each token after the first is predicted once; up to --windows); else one held-out set
    (default report) in consecutive windows, as a run that trained or chose on the same text saw it. Returns the
    windows (a list of [n, seq + 1] and possibly a shorter last one), the unigram baseline's counts, and a
    description of what was scored."""
    from ..text.data import covering_windows, held_out_windows

    if args.data and not args.held_out:
        stream, lengths = corpus.in_file_order()
        parts = covering_windows(stream, args.seq + 1, args.windows)
        end = sum(len(w) * (w.shape[1] - 1) for w in parts) + 1  # tokens covered, from the start
        docs = int((np.concatenate([[0], np.cumsum(lengths)[:-1]]) < end).sum())
        return parts, stream, {"set": "all", "documents": docs, "documents_in_data": corpus.documents}
    role = args.held_out or "report"
    windows = held_out_windows(corpus, role, args.seq + 1, limit=args.windows or 64, use="eval --held-out")
    return [windows], corpus.train, {"set": role, "documents": corpus.set_documents(role, windows.numel()),
                                     "documents_in_data": corpus.documents}


def evaluate(args) -> int:
    from .. import evaluation as evaluate, ir
    from ..backends.torch.stream import StreamedProgram
    from ..text.data import corpus_for
    from ..text.tokenizer import check_shared, set_tokenizer, vocab_of
    from .default_model import model_path

    if args.tasks:
        from .tasks import eval_command

        return eval_command(args)
    compute = compute_of(args)
    if args.k > args.new_tokens:
        raise UsageError(f"--k {args.k} drafts more tokens per step than --new-tokens {args.new_tokens} generates")
    prog = ir.verify(load_model(args, text=True))
    teacher = None
    if args.teacher:  # before any work: the two must share a tokenizer
        teacher = ir.verify(ir.load(model_path(args.teacher)))
        set_tokenizer(teacher, args.tokenizer)
        check_shared(prog, teacher)
    corpus = corpus_for(prog, args.data, progress=not args.json and sys.stderr.isatty())
    parts, counts, scored = _scored_text(args, corpus)
    windows = parts[0] if parts[0].shape[1] == args.seq + 1 else None
    if windows is None or len(windows) < args.prompts:
        have = 0 if windows is None else len(windows)
        raise UsageError(f"--prompts {args.prompts} needs as many whole windows of --seq {args.seq} + 1 tokens; the "
                         f"{'text' if scored['set'] == 'all' else scored['set'] + ' set'} gives {have}: give fewer "
                         "--prompts, a shorter --seq, or more text")
    model = StreamedProgram(prog, compute)
    each = [evaluate.text_metrics(model, w, corpus.token_bytes) for w in parts]
    nll, tokens, nbytes = (sum(m["nll_per_token"] * m["tokens"] for m in each), sum(m["tokens"] for m in each),
                           sum(m["bytes"] for m in each))
    unigram = sum(evaluate.unigram_bits_per_byte(counts, w, vocab_of(prog), corpus.token_bytes) * m["bytes"]
                  for w, m in zip(parts, each)) / nbytes
    res = {"model": str(model_path(args.model)), "compute": str(compute), "tokenizer": corpus.tokenizer.name,
           "scored": scored["set"], "documents": scored["documents"], "valid_bytes": nbytes, "valid_tokens": tokens,
           "bits_per_byte": nll / nbytes / evaluate.LN2, "nll_per_token": nll / tokens,
           "perplexity": math.exp(min(nll / tokens, 700.0)), "unigram_bits_per_byte": unigram}
    if model.program.find("mtp"):
        res["mtp_top1_accuracy"] = each[0]["mtp_top1_accuracy"]  # on `windows`, from the same pass
        prompts = windows[: args.prompts, : args.seq // 2]
        res["acceptance_length"] = evaluate.acceptance_length(model, prompts, args.k, args.new_tokens)
        res["draft_tokens"] = args.k
    if teacher is not None:
        res.update(evaluate.teacher_agreement(StreamedProgram(teacher, compute), model, windows))
    what = "the whole --data" if scored["set"] == "all" else f"the held-out {scored['set']} set"
    head = (f"scored {tokens:,} tokens ({nbytes:,} bytes) in {scored['documents']:,} of "
            f"{scored['documents_in_data']:,} documents: {what}\n")
    lines = [f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}" for k, v in res.items()]
    emit(args, res, head + "\n".join(lines) + "\n")
    return 0


def greedy(prefill, decode, n: int, logits_of, model=None, stop: int | None = None):
    """Up to `n` greedy tokens [batch, <= n] from `prefill()` and `decode(tokens, state)`, which return (outputs,
    state); it ends early once every row has produced `stop` (EOS), as transformers' generate does. Non-finite
    logits stop it naming the likely cause, rather than decoding NaN as token 0."""
    import numpy as np

    from ..evaluation import check_finite

    outs, state = prefill()
    new, done = [], None
    for i in range(n):
        where = "prefill" if i == 0 else f"decode step {i}"
        logits = check_finite(np.asarray(logits_of(outs))[:, -1], f"logits at {where}", model)
        new.append(logits.argmax(-1))
        if stop is not None:  # the rows that have produced EOS so far, updated per step (not restacked)
            done = (new[-1] == stop) if done is None else done | (new[-1] == stop)
            if done.all():
                break
        if i + 1 < n:
            outs, state = decode(new[-1], state)
    return np.stack(new, axis=1)


def cached_onnx(prog) -> Path:
    """The program's ONNX export, made once per program (keyed by its hash: text and weights) under
    $PUZZLEKIT_CACHE/onnx (default ~/.cache/puzzlekit/onnx), so that generate does not export on every call."""
    from ..backends.onnx import export_onnx
    from ..outputs import cache_dir
    from ..ir.identity import program_hash

    d = cache_dir("onnx") / program_hash(prog)[:32]
    if not (d / "prefill.onnx").exists():  # the export is staged and renamed into place: complete or absent
        export_onnx(prog, d)
    return d


def generate(args) -> int:
    import numpy as np
    import torch

    from .. import ir
    from ..backends.torch import materialize
    from ..text.tokenizer import tokenizer_of

    compute = compute_of(args)
    prog = ir.verify(load_model(args, text=True))
    tok = tokenizer_of(prog)
    text = args.prompt
    if args.chat:
        from ..text.tokenizer import TemplateError

        try:
            text = tok.render_chat([{"role": "user", "content": args.prompt}], generation_prompt=True)
        except TemplateError as e:  # a base model's template that refuses chat, a broken template
            short = args.prompt if len(args.prompt) <= 60 else args.prompt[:57] + "..."
            raise TemplateError(f"--chat: the prompt {short!r} as a user message: {e}; drop --chat to send the "
                                "prompt as plain text") from None
    prompt = tok.prompt(text)[None]
    if not args.prompt or prompt.size == 0:
        raise UsageError("the prompt is empty")
    if args.backend == "onnx":
        from ..backends.onnx import OnnxModel

        fp4 = sorted({f for n in prog.nodes for _, f in n.op.quant if f.startswith("nvfp4")})
        if fp4:
            raise UsageError(f"--backend onnx: the model is quantized with {', '.join(fp4)}, and onnxruntime has no FP4 "
                             "kernels (its FP4 ops are TensorRT's); use --backend torch, or build engines for an FP4 "
                             "GPU with build-engine")
        om = OnnxModel(cached_onnx(prog))
        new = greedy(lambda: om.prefill(prompt), om.decode, args.max_new_tokens, lambda outs: outs["logits"],
                      stop=tok.eos_id)
    else:
        m = materialize(prog, compute=compute, inference=True)
        with torch.no_grad():
            new = greedy(lambda: m.prefill(torch.from_numpy(prompt)),
                          lambda t, state: m.decode(torch.from_numpy(t), state), args.max_new_tokens,
                          lambda outs: outs[0].float().cpu().numpy(), m, stop=tok.eos_id)
    completion = tok.decode(new[0])
    tokens = np.concatenate([prompt, new], 1)[0].tolist()
    emit(args, {"prompt": args.prompt, "completion": completion, "tokens": tokens, "new_tokens": new[0].tolist(),
                "backend": args.backend, "tokenizer": tok.name}, text + completion + "\n")
    return 0
