"""puzzlekit programs as an lm-evaluation-harness model, registered as `puzzlekit` when this module is imported.

    import puzzlekit.evaluation.lm_eval_model, lm_eval
    lm_eval.simple_evaluate(model="puzzlekit", model_args="pretrained=DIR,device=cuda,dtype=bfloat16", tasks=[...])

It runs on puzzlekit's own backend, so whatever `ir.load` reads evaluates: the published child, the extended
form, a quantised child (its weights dequantised, activations quantised as the engines do), and, with
`max_memory`, a model larger than memory streamed layer by layer. Log-likelihoods come from one batched
forward per batch of requests (right-padded: nothing causal sees the padding); generation is greedy, with the
decode state (KV and SSM caches) when the model is held whole. Tokenization follows lm-eval's `hf` model on the
same tokenizer (its special tokens, its BOS), so the two score the same token ids.
"""
from __future__ import annotations

import lm_eval.models  # noqa: F401  the built-in models first: lm-eval loads them only into an empty registry
import sys

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from .. import ir
from ..backends.torch import materialize
from ..backends.torch.device import resolve
from ..backends.torch.stream import StreamedProgram
from ..errors import UsageError
from ..text.tokenizer import set_tokenizer, tokenizer_of

#: the byte codec has no end-of-text id; a newline starts a document for the built-in model (its separator)
BYTE_EOT = 10
#: lm-eval's `hf` model's context length when a config names none
DEFAULT_MAX_LENGTH = 2048


def _logits(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


@register_model("puzzlekit")
class PuzzlekitLM(TemplateLM):
    """An lm-eval model over a puzzlekit program. model_args: pretrained (a checkpoint directory), device,
    dtype, batch_size, max_length, max_memory (stream the model within this budget), tokenizer, add_bos_token,
    max_gen_toks; from Python, `program=` an `ir.Program` and `compute=` a `Compute`."""

    def __init__(self, pretrained=None, device: str = "cpu", dtype: str = "", batch_size=8, max_length=None,
                 max_memory: str = "", tokenizer=None, add_bos_token=None, max_gen_toks: int = 256, program=None,
                 compute=None, **unused):
        super().__init__()
        if program is None and not pretrained:
            raise UsageError("the puzzlekit lm-eval model needs pretrained=DIR (a checkpoint directory)")
        prog = program if program is not None else ir.verify(ir.load(pretrained))
        if tokenizer:
            set_tokenizer(prog, tokenizer)
        self.program, self.codec = prog, tokenizer_of(prog)
        self.compute = compute or resolve(device or "cpu", dtype or "", max_memory or "")
        weights = sum(prog.weights.nbytes(k) for k in prog.weights.names())
        streamed = bool(max_memory or self.compute.memory) and weights > self.compute.budget // 2
        self.model = StreamedProgram(prog, self.compute) if streamed else \
            materialize(prog, compute=self.compute, inference=True)
        self.batch_size = 8 if batch_size in (None, "auto") or str(batch_size).startswith("auto") else int(batch_size)
        limit = (prog.meta.get("config") or {}).get("max_position_embeddings")
        self._max_length = int(max_length) if max_length else int(limit or DEFAULT_MAX_LENGTH)
        self.add_bos_token = add_bos_token if add_bos_token is None else str(add_bos_token).lower() == "true"
        self.max_gen_toks = int(max_gen_toks)
        self.hf = getattr(self.codec, "tok", None)  # the transformers tokenizer, None for the byte codec

    # -- what lm-eval asks of a model --------------------------------------------------------------------------
    @property
    def device(self):
        return self.compute.device

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def eot_token_id(self) -> int:
        return BYTE_EOT if self.hf is None else self.hf.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What a text with nothing before it is scored after (rolling log-likelihood, an empty context): BOS,
        else EOS, as lm-eval's `hf` model takes; a tokenizer with neither is refused (`hf` fails on None)."""
        if self.hf is not None and self.hf.bos_token_id is not None:
            return self.hf.bos_token_id
        if self.eot_token_id is None:
            raise UsageError(f"the tokenizer {self.codec.name} has neither a BOS nor an EOS token, and lm-eval scores "
                             "a text with nothing before it (rolling log-likelihood, an empty context) after one of "
                             "them: give the tokenizer a bos_token or eos_token (tokenizer_config.json)")
        return self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.codec.name.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if self.hf is None or not chat_template:
            return None
        return chat_template if isinstance(chat_template, str) else getattr(self.hf, "chat_template", None)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.codec.render_chat(chat_history, generation_prompt=add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if self.hf is None:
            return list(string.encode("utf-8"))
        special = {"add_special_tokens": add_special_tokens} if add_special_tokens is not None else \
            {"add_special_tokens": self.add_bos_token} if self.add_bos_token is not None else {}
        bos = self.hf.bos_token
        if add_special_tokens is None and bos and string.startswith(bos):  # a rendered chat carries its BOS
            special = {"add_special_tokens": False}
        return self.hf.encode(string, **special)

    def tok_decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace") if self.hf is None else \
            self.hf.decode(list(ids), skip_special_tokens=True)

    # -- scoring -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """(sum of the continuation's log-probabilities, whether it is the greedy continuation) per request."""
        rows = []
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:  # lm-eval's `hf` model asserts this; a line saying so instead
                raise UsageError(f"a continuation (an answer) of {len(continuation):,} tokens is longer than the "
                                 f"model's context of {self.max_length:,} tokens: it cannot be scored; give the "
                                 "model a longer max_length (model_args max_length=N), or leave out the task")
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append((whole[:-1], len(continuation)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # long first: even batches
        out: list = [None] * len(rows)
        bs = override_bs or self.batch_size
        for start in tqdm(range(0, len(order), bs), disable=disable_tqdm or not sys.stderr.isatty(),
                          desc="loglikelihood"):
            chunk = order[start:start + bs]
            width = max(len(rows[i][0]) for i in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, i in enumerate(chunk):
                ids[r, :len(rows[i][0])] = torch.tensor(rows[i][0])
            logits = _logits(self.model(ids.to(self.device)))
            for r, i in enumerate(chunk):  # float32 over the continuation only: [k, vocab], not [batch, T, 131k]
                n, k = len(rows[i][0]), rows[i][1]
                target = torch.tensor((list(requests[i][1]) + list(requests[i][2]))[-k:])
                lp = F.log_softmax(logits[r, n - k:n].float(), dim=-1).cpu()
                out[i] = (float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
        for req, ans in zip(requests, out):
            if req[0] is not None:
                self.cache_hook.add_partial("loglikelihood", req[0], ans)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's whole log-likelihood, scored in disjoint windows of at most `max_length` tokens."""
        out = []
        for req in tqdm(requests, disable=disable_tqdm or not sys.stderr.isatty(), desc="loglikelihood_rolling"):
            windows = [(None,) + w for w in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(req.args[0]), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))]
            total = sum(ll for ll, _ in self._loglikelihood_tokens(windows, disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            out.append(total)
        return out

    # -- generation --------------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first stop string (and the end-of-text token)."""
        out = []
        for req in tqdm(requests, disable=disable_tqdm or not sys.stderr.isatty(), desc="generate_until"):
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            if kwargs.get("do_sample") or (kwargs.get("temperature") or 0) > 0:
                raise UsageError("the puzzlekit lm-eval model generates greedily; this task asks for sampling "
                                 "(do_sample/temperature): run it with --model hf, or set its generation_kwargs")
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            eot = self.tok_decode([self.eot_token_id]) if self.eot_token_id is not None else ""  # no EOS: the stops
            if eot and eot not in until:
                until.append(eot)
            n = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = self.tok_encode(context)[-max(1, self.max_length - n):]
            text = self._greedy(ids, n, until)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out

    @torch.no_grad()
    def _greedy(self, ids: list[int], n: int, until: list[str]) -> str:
        """Up to `n` greedy tokens after `ids`, ending once a stop string or the end-of-text token appears: with
        the decode state when the model is held whole, else (streamed) a full forward per token."""
        new: list[int] = []
        x = torch.tensor([ids], device=self.device)
        stateful = hasattr(self.model, "decode")
        if stateful:
            outs, state = self.model.prefill(x)
        else:
            outs = self.model(x)
        for _ in range(n):
            token = int(_logits(outs)[0, -1].argmax())
            new.append(token)
            if token == self.eot_token_id and self.hf is not None:
                break
            if any(s and s in self.tok_decode(new) for s in until):
                break
            if stateful:
                outs, state = self.model.decode(torch.tensor([token], device=self.device), state)
            else:
                outs = self.model(torch.tensor([ids + new], device=self.device))
        return self.tok_decode(new)


__all__ = ["PuzzlekitLM"]
