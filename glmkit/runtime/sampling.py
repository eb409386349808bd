"""Choosing the next token from logits: greedy, or temperature + top-k + top-p with a seeded RNG."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from glmkit.errors import GlmkitError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy. top_k 0 = off. top_p 1 = off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def check(self) -> SamplingParams:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise GlmkitError(f"--temp: must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise GlmkitError(f"--top-p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise GlmkitError(f"--top-k: must be >= 0, got {self.top_k}")
        if self.seed is not None and self.seed < 0:
            raise GlmkitError(f"--seed: must be >= 0, got {self.seed}")
        return self


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params.check()
        self.rng = np.random.default_rng(params.seed)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    def __call__(self, logits: np.ndarray) -> int:
        """logits `[V]` -> token id."""
        if self.greedy:
            return int(np.argmax(logits))
        return int(self.rng.choice(len(logits), p=token_probabilities(logits, self.params)))


def token_probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Softmax(logits / T) restricted to the top-k, then to the smallest set with mass >= top_p."""
    z = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < len(z):
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1:
        order = np.argsort(-p, kind="stable")
        cumulative = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cumulative, params.top_p)) + 1]
        mask = np.zeros_like(p)
        mask[keep] = p[keep]
        p = mask / mask.sum()
    return p
