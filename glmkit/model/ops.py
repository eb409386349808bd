"""The pure functions of the GLM-5 forward pass: RoPE, masks, the DSA top-k, the noaux_tc router, MoE batching.

Each is one equation of docs/DESIGN.md on NumPy arrays; the model and every backend share them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from glmkit.format.packing import dequantize
from glmkit.format.tensors import QuantWeight, Weight

# q_a_layernorm, kv_a_layernorm and the indexer's k_norm are built with eps 1e-6 regardless of
# rms_norm_eps (transformers' GlmMoeDsaRMSNorm default / nn.LayerNorm(eps=1e-6)).
LATENT_NORM_EPS = 1e-6


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def sigmoid(x: np.ndarray) -> np.ndarray:
    # exp(-x) overflows to inf for x < -88, which correctly gives 0; silence only that warning.
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)


def rope_cos_sin(positions: np.ndarray, dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin `[S, dim/2]` of angles `pos * theta^(-2i/dim)`, computed in float32 like transformers."""
    inv_freq = np.float32(1.0) / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    angles = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)



def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate interleaved pairs (x0,x1),(x2,x3).. of `x [S, ..., d]` by the angles of row S.

    The output is de-interleaved, `concat(e*cos - o*sin, o*cos + e*sin)` with `e = x[0::2]`,
    `o = x[1::2]`: queries and keys get the same permutation, so their dot products are unchanged.
    """
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    even, odd = x[..., 0::2], x[..., 1::2]
    return np.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1)


def position_mask(positions: np.ndarray, total: int) -> np.ndarray:
    """`[S, T]` bool: the query at `positions[s]` may see keys 0..positions[s] of `total` cached ones."""
    return np.arange(total)[None, :] <= positions[:, None]


def topk_mask(scores: np.ndarray, causal: np.ndarray, k: int) -> np.ndarray:
    """DSA selection `[S, T]` bool: per query the `min(k, t+1)` largest scores among its causal keys.

    Ties at the k-th score go to the lowest key indices, as in the OpenCL kernel: indexer scores tie exactly
    (at 0, when every head's ReLU is off), and backends must pick the same keys.
    """
    total = scores.shape[1]
    if k >= total:
        return causal
    masked = np.where(causal, scores, np.float32(-np.inf))
    kth = np.full((len(masked), 1), -np.inf, np.float32)  # the k-th largest per row: -inf with fewer than k keys
    # blocks of rows partition only the columns up to their last allowed key (the rest are -inf): a causal prefill's
    # early rows skip most columns
    width = total - np.argmax(causal[:, ::-1], axis=-1)
    for rows in np.array_split(np.arange(len(masked)), max(1, min(8, len(masked) // 64))):
        cols = int(width[rows].max()) if len(rows) else 0
        if cols >= k:
            kth[rows, 0] = np.partition(masked[rows, :cols], cols - k, axis=-1)[:, cols - k]
    above = masked > kth
    ties = masked == kth
    room = k - above.sum(axis=-1, keepdims=True)
    keep = above | ties
    # rows whose ties at the k-th score outnumber the room left keep the lowest-index ones (a running count only
    # there: over every row it dominates a long prefill's selection). Non-causal keys are -inf, so they only
    # tie when a query has fewer than k causal keys; `& causal` drops them
    over = np.flatnonzero(ties.sum(axis=-1) > room[:, 0])
    keep[over] = above[over] | (ties[over] & (np.cumsum(ties[over], axis=-1) <= room[over]))
    return keep & causal


def chosen_keys(selected: np.ndarray, k: int) -> np.ndarray:
    """A selection `[S, T]` bool of at most k keys per row -> its key indices `[S, k]` int32, ascending per row,
    padded with -1 (rows with fewer than k keys)."""
    rows, cols = np.nonzero(selected)  # row-major: each row's keys ascending
    if len(cols) == selected.shape[0] * k:  # every row has k keys (the usual case past k keys)
        return cols.astype(np.int32).reshape(-1, k)
    counts = np.bincount(rows, minlength=selected.shape[0])
    rank = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)  # a key's place in its row
    out = np.full((selected.shape[0], k), -1, np.int32)
    out[rows, rank] = cols
    return out


def route_noaux_tc(logits: np.ndarray, bias: np.ndarray, top_k: int, n_group: int, topk_group: int,
                   norm_topk_prob: bool, scaling: float) -> tuple[np.ndarray, np.ndarray]:
    """noaux_tc router: logits `[S, E]` -> (expert ids `[S, k]`, weights `[S, k]`).

    Selection uses `sigmoid(logits) + bias`, restricted to the `topk_group` groups with the largest
    top-2 sums (the other groups are -inf, not 0); the weights are the unbiased sigmoid scores.
    """
    seq, experts = logits.shape
    scores = sigmoid(logits)
    choice = scores + bias
    grouped = choice.reshape(seq, n_group, experts // n_group)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)  # [S, n_group]
    best_groups = np.argpartition(-group_scores, topk_group - 1, axis=-1)[:, :topk_group]
    group_keep = np.zeros((seq, n_group), bool)
    np.put_along_axis(group_keep, best_groups, True, axis=-1)
    expert_keep = np.repeat(group_keep, experts // n_group, axis=1)
    choice = np.where(expert_keep, choice, np.float32(-np.inf))
    ids = np.argpartition(-choice, top_k - 1, axis=-1)[:, :top_k]
    weights = np.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    return ids, (weights * np.float32(scaling)).astype(np.float32)



def moe_batch_union(x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                    run_expert: Callable[[int, np.ndarray], np.ndarray],
                    parallel_map: Callable[[Callable, list], list] | None = None, chunk: int = 1,
                    done: Callable[[int], None] | None = None) -> np.ndarray:
    """`sum_k weights[s,k] * E_{ids[s,k]}(x[s])` `[S, H]`, running each unique expert once on its rows.

    Loading an expert's weights is the cost that matters (they stream from disk), so every expert
    routed to by any row of the batch is called exactly once with all of its rows.
    parallel_map: `map(fn, items) -> list` that may run `chunk` experts at a time (on a thread pool); their
    outputs are summed in expert order either way, so the result does not depend on it.
    done: called with each expert once its rows have run (its weights are not read again by this call).
    """
    out = np.zeros_like(x)
    picks = [(int(e), *np.nonzero(ids == e)) for e in np.unique(ids)]  # a row picks an expert at most once
    for c0 in range(0, len(picks), chunk):
        group = picks[c0:c0 + chunk]
        if parallel_map is None:
            results = [run_expert(e, x[rows]) for e, rows, _ in group]
        else:
            results = parallel_map(lambda pick: run_expert(pick[0], x[pick[1]]), group)
        for (_, rows, slots), y in zip(group, results, strict=True):
            out[rows] += weights[rows, slots, None] * y
        del results  # freed before the next group runs, not beside it
        if done is not None:
            for e, _, _ in group:
                done(e)
    return out


def likely_experts(x: np.ndarray, router: np.ndarray, bias: np.ndarray, top_k: int) -> list[int]:
    """The experts a noaux_tc router would likely pick for rows `x [S, H]`: the union over rows of the `top_k` best
    choice scores `sigmoid(x router^T) + bias` (groups ignored). Read-ahead applies a layer's router to the previous
    layer's hidden state, normed as the layer norms it (`renormalized`): a cheap, usually close estimate."""
    scores = sigmoid(x @ router.T) + bias  # [S, E]
    return np.unique(np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k]).tolist()


def embed_rows(table: Weight, ids: np.ndarray) -> np.ndarray:
    """Embedding rows `[S, H]` float32; a quantized table dequantizes only the gathered rows."""
    if isinstance(table, QuantWeight):
        return dequantize(table.packed[ids], table.scales[ids], table.bits, table.group_size, table.shape[1],
                          table.scheme)
    return np.asarray(table[ids], dtype=np.float32)


def renormalized(normed: np.ndarray, weight: np.ndarray, next_weight: np.ndarray) -> np.ndarray:
    """`normed [S, H]` = `RMSNorm(h) * weight`, as another RMSNorm of the same `h` gives it: `RMSNorm(h) *
    next_weight` (exact where `weight` is not 0; 0 where it is)."""
    ratio = np.divide(next_weight, weight, out=np.zeros(weight.shape, np.float32), where=weight != 0)  # [H]
    return normed * ratio  # [S, H]
