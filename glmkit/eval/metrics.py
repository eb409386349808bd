"""Quality metrics of a model against text and against a reference model (pure NumPy, float64).

Per scored position (a window of n tokens scores positions 0..n-2, each predicting the next token):
- negative log-likelihood of the actual next token; perplexity = exp(mean NLL);
- KL divergence `KL(P_base || Q) = sum_v p_base(v) (log p_base(v) - log q(v))`, the llama.cpp
  `--kl-divergence` quantity: how far the test model's next-token distribution is from the reference's;
- top-1 agreement: whether both models' most likely next token is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax `[N, V]` in float64 (stable: the row max is subtracted first)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_nll(logprobs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """`-log p(target)` per row: logprobs `[N, V]`, targets `[N]` -> `[N]`."""
    return -np.take_along_axis(np.asarray(logprobs, np.float64), np.asarray(targets)[:, None], axis=1)[:, 0]


def perplexity(nll: np.ndarray) -> float:
    """exp(mean NLL) over all rows."""
    return float(np.exp(np.mean(nll)))


def kl_divergence(base_logprobs: np.ndarray, logprobs: np.ndarray) -> np.ndarray:
    """`KL(P_base || Q)` per row `[N]` from log-probabilities `[N, V]` (0 log 0 counts as 0)."""
    base = np.asarray(base_logprobs, np.float64)
    test = np.asarray(logprobs, np.float64)
    p = np.exp(base)
    # where p == 0 the term is 0 even if q == 0 (base -inf minus test -inf would be nan)
    with np.errstate(invalid="ignore"):
        terms = p * np.where(p > 0, base - test, 0.0)
    return terms.sum(axis=-1)


def top1_matches(base_logprobs: np.ndarray, logprobs: np.ndarray) -> np.ndarray:
    """Per row: do both distributions have the same most likely token (first index on ties)?"""
    return np.argmax(base_logprobs, axis=-1) == np.argmax(logprobs, axis=-1)


@dataclass
class QualityAccumulator:
    """Collects per-position NLL (and, against a base, KL and top-1) window by window."""

    nll: list[np.ndarray] = field(default_factory=list)
    base_nll: list[np.ndarray] = field(default_factory=list)
    kld: list[np.ndarray] = field(default_factory=list)
    top1: list[np.ndarray] = field(default_factory=list)

    def add(self, logprobs: np.ndarray, targets: np.ndarray, base_logprobs: np.ndarray | None = None) -> None:
        self.nll.append(token_nll(logprobs, targets))
        if base_logprobs is not None:
            self.base_nll.append(token_nll(base_logprobs, targets))
            self.kld.append(kl_divergence(base_logprobs, logprobs))
            self.top1.append(top1_matches(base_logprobs, logprobs))

    def summary(self) -> dict[str, float | int]:
        """`{"tokens", "ppl"}`, plus `kld_mean`, `kld_p99`, `top1_agreement` (and its binomial standard error
        `top1_se`), `ppl_ratio` against a base."""
        nll = np.concatenate(self.nll) if self.nll else np.zeros(0)
        if nll.size == 0:
            raise ValueError("no scored tokens")
        out: dict[str, float | int] = {"tokens": int(nll.size), "ppl": perplexity(nll)}
        if self.kld:
            kld = np.concatenate(self.kld)
            out["kld_mean"] = float(kld.mean())
            out["kld_p99"] = float(np.quantile(kld, 0.99))
            top1 = float(np.concatenate(self.top1).mean())
            out["top1_agreement"] = top1
            out["top1_se"] = float(np.sqrt(top1 * (1 - top1) / nll.size))
            out["ppl_ratio"] = out["ppl"] / perplexity(np.concatenate(self.base_nll))
        return out
