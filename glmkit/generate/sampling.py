"""Choosing the next token from logits: greedy, or temperature + top-k + top-p with a seeded RNG, optionally among
the tokens a constraint allows (`glmkit.generate.constraint`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from glmkit.errors import GlmkitError
from glmkit.model.compute import TokenMask


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy. top_k 0 = off. top_p 1 = off. presence_penalty / frequency_penalty (OpenAI's): each
    token's logit lowers by `presence * (n > 0) + frequency * n`, n its count among the tokens chosen so far.
    logit_bias: (token id, bias in [-100, 100]) pairs added to those tokens' logits."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def check(self) -> SamplingParams:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise GlmkitError(f"--temp: must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise GlmkitError(f"--top-p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise GlmkitError(f"--top-k: must be >= 0, got {self.top_k}")
        if self.seed is not None and self.seed < 0:
            raise GlmkitError(f"--seed: must be >= 0, got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise GlmkitError(f"--{name.replace('_', '-')}: must be between -2 and 2, got {value}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100 <= bias <= 100:
                raise GlmkitError(f"logit_bias: token {token} -> {bias} (ids >= 0, biases in [-100, 100])")
        return self

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties or biases change the logits before the choice."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability under the model (its raw logits: before temperature, top-k/p and any
    constraint), and the `top` most likely tokens' (id, log-probability), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """`TokenLogprob` of `token` from logits `[V]` (log-softmax in float64)."""
    z = logits.astype(np.float64)
    logp = z - (z.max() + np.log(np.exp(z - z.max()).sum()))  # [V]
    n = min(top, len(logp))
    best = np.argpartition(-logp, n - 1)[:n] if n else np.zeros(0, np.int64)
    best = best[np.argsort(-logp[best], kind="stable")]  # most likely first
    return TokenLogprob(token, float(logp[token]), tuple((int(i), float(logp[i])) for i in best))


class LogitsConstraint(TokenMask, Protocol):
    """Which tokens may come next (`mask`: the others' logits at -inf; as a bitmask for a device that masks the logits
    itself: `TokenMask`), told each token chosen (`accept`)."""

    def mask(self, logits: np.ndarray) -> np.ndarray: ...


class Sampler:
    """Chooses each token of one sequence, in order: with a `constraint`, every call is that sequence's next token."""

    def __init__(self, params: SamplingParams, constraint: LogitsConstraint | None = None,
                 logprobs: int | None = None):
        """logprobs: record each chosen token's `TokenLogprob` with this many most likely tokens (None: none)."""
        self.params = params.check()
        self.rng = np.random.default_rng(params.seed)
        self.constraint = constraint
        self.logprobs = logprobs
        self.chosen: list[TokenLogprob] = []  # with `logprobs`: one per call, in order
        self.counts: dict[int, int] = {}  # with penalties: how often each token was chosen
        bias = params.logit_bias
        self.bias_ids = np.array([token for token, _ in bias], np.int64)  # made once: applied to every token's logits
        self.bias_values = np.array([value for _, value in bias], np.float32)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    @property
    def host_only(self) -> bool:
        """Whether every choice needs the logits on the host (penalties or biases, logprobs to report), even where a
        device masks them by a constraint's bitmask."""
        return self.logprobs is not None or self.params.adjusts_logits

    def __call__(self, logits: np.ndarray) -> int:
        """logits `[V]` -> token id: `Generator.choice(V, p=token_probabilities(...))`'s draw (one uniform from the
        seeded stream, the first token whose cumulative probability exceeds it), over the tokens p keeps (and the
        constraint allows)."""
        scored = self._adjusted(logits) if self.params.adjusts_logits else logits
        if self.constraint is None:
            token = self._choose(scored)
        else:
            token = self._choose(self.constraint.mask(scored))
            self.constraint.accept(token)
        if self.logprobs is not None:
            self.chosen.append(token_logprob(logits, token, self.logprobs))
        if self.params.adjusts_logits:
            self.counts[token] = self.counts.get(token, 0) + 1
        return token

    def _adjusted(self, logits: np.ndarray) -> np.ndarray:
        """logits `[V]` plus the logit biases, less each chosen token's presence and frequency penalties (a copy)."""
        out = np.array(logits, np.float32)
        inside = self.bias_ids < len(out)
        np.add.at(out, self.bias_ids[inside], self.bias_values[inside])  # add.at: a token named twice gets both
        if self.counts:
            ids = np.fromiter(self.counts, np.int64, len(self.counts))
            times = np.fromiter(self.counts.values(), np.float32, len(self.counts))
            out[ids] -= np.float32(self.params.presence_penalty) + np.float32(self.params.frequency_penalty) * times
        return out

    def _choose(self, logits: np.ndarray) -> int:
        if self.greedy:
            return int(np.argmax(logits))
        return self.pick(logits, None)

    def pick(self, logits: np.ndarray, u: float | None) -> int:
        """The token of `token_probabilities` for uniform `u` in [0, 1) (None: the next of the seeded stream): the
        first whose cumulative probability exceeds u. A device that draws tokens calls it with the uniform it took
        from `rng` where it cannot decide itself."""
        p = token_probabilities(logits, self.params)
        support = np.flatnonzero(p)  # zeros do not move a running sum: the same cdf as over all of p
        cdf = np.cumsum(p[support])
        if not np.isfinite(cdf[-1]):
            raise GlmkitError("sampling: the logits hold NaN or infinity")
        cdf /= cdf[-1]
        return int(support[np.searchsorted(cdf, self.rng.random() if u is None else u, side="right")])


# first candidates for the top-p set, and their growth while their mass falls short (most nucleus sets of a
# trained model hold tens to hundreds of tokens; sorting GLM-5's 154,880 logits took 21 ms a token)
NUCLEUS_CANDIDATES, NUCLEUS_GROWTH = 1024, 8


def token_probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Softmax(logits / T) restricted to the top-k, then to the smallest set with mass >= top_p."""
    z = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < len(z):
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1:
        keep = nucleus(p, params.top_p)
        mask = np.zeros_like(p)
        mask[keep] = p[keep]
        p = mask / mask.sum()
    return p


def nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest set of most probable tokens with mass >= top_p, in the order of a stable descending
    sort of p (ties by index). Sorts only the top candidates, all tokens at least as probable as the m-th: a prefix
    of that order with the same running sums, so the cut falls where a sort of all of p would put it."""
    m = NUCLEUS_CANDIDATES
    while True:
        whole = m >= len(p)
        candidates = np.arange(len(p)) if whole else np.flatnonzero(p >= np.partition(p, len(p) - m)[len(p) - m])
        order = candidates[np.argsort(-p[candidates], kind="stable")]
        cumulative = np.cumsum(p[order])
        if whole or cumulative[-1] >= top_p:
            return order[: int(np.searchsorted(cumulative, top_p)) + 1]
        m *= NUCLEUS_GROWTH
