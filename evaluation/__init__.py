"""Evaluation: metrics over windows (`metrics`), of decoding (`decoding`), and lm-eval's model over a
checkpoint (`lm_eval_model`, imported on its own: it needs the `lm-eval` extra)."""
from .decoding import Drafter, acceptance_length, decode_throughput, mtp_drafter
from .metrics import (LN2, NonFiniteError, agrees, bits_per_byte, check_finite, count_bytes, kl, mtp_accuracy, nll,
                      teacher_agreement, text_metrics, topk_kl, unigram_bits_per_byte)

__all__ = ["LN2", "Drafter", "NonFiniteError", "acceptance_length", "agrees", "bits_per_byte", "check_finite",
           "count_bytes", "decode_throughput", "kl", "mtp_accuracy", "mtp_drafter", "nll", "teacher_agreement",
           "text_metrics", "topk_kl", "unigram_bits_per_byte"]
