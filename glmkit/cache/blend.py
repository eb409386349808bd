"""Recompute KV rows at chosen positions in place (CacheBlend-style), for approximate prefill reuse.

`model.forward` appends a contiguous block of tokens at the end of the cache. Approximate reuse needs more: the
cache already holds rows at every position (imported from chunks stored elsewhere, or placeholders), and a
SET of positions - the gaps between reused spans and the reused spans' first tokens - must be computed, each
attending to every row at or before its own position. Done left to right with `forward`, that costs one
forward per gap; here it is one pass: per layer, the rows of all chosen positions are computed and written
first, then their queries attend under a by-position causal mask. Every position therefore sees exactly what
a left-to-right build would have shown it.

The layer math is `GlmMoeDsaModel`'s own: its `decoder_layer` takes the positions of its rows, appending when
they continue the cache (`forward`) and writing them in place otherwise (here), so both paths run one method.
`tests/test_semantic_reuse.py` checks that recomputing a contiguous block this way equals `model.forward`.
"""

from __future__ import annotations

import numpy as np

from glmkit.model.glm5 import GlmMoeDsaModel
from glmkit.model.kv_cache import KVCache


def forward_at(model: GlmMoeDsaModel, token_ids: np.ndarray, positions: np.ndarray, cache: KVCache) -> np.ndarray:
    """Recompute, in every main layer, the rows of `token_ids` at `positions` (strictly increasing, each below the
    cache length) against all cached rows at or before each position; returns the post-final-norm hidden
    states `[S, H]` of those positions. The MTP layer is not touched."""
    positions = np.asarray(positions, dtype=np.int64)
    x = model.embed(np.asarray(token_ids, dtype=np.int64))
    chosen = None
    for layer in range(model.config.num_hidden_layers):
        x, chosen = model.decoder_layer(layer, x, positions, cache.layer(layer), chosen)
    return model.final_norm(x)


def blend_forward(model: GlmMoeDsaModel, token_ids: np.ndarray, positions: np.ndarray, cache: KVCache,
                  imported: np.ndarray, ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """CacheBlend's selective recompute over `positions` (strictly increasing, below the cache length), of which
    `imported` (bool mask) hold reused rows and the rest must be computed.

    Layer 0 is computed for every position (its rows depend on the token alone, so reused ones do not change).
    Then each reused position's layer-1 `kv_lat` is recomputed from that layer-0 output and compared with the
    reused row; the `ratio` fraction of reused positions that deviate most join the computed ones for layers 1
    and up, the others keep their reused rows. Returns (post-final-norm hidden states of the computed positions,
    those positions)."""
    positions = np.asarray(positions, dtype=np.int64)
    x = model.embed(np.asarray(token_ids, dtype=np.int64))
    x, chosen = model.decoder_layer(0, x, positions, cache.layer(0), None)
    keep = ~np.asarray(imported, dtype=bool)
    reused = np.flatnonzero(~keep)
    count = min(len(reused), int(np.ceil(ratio * len(reused) - 1e-9)))
    if count and model.config.num_hidden_layers > 1:
        fresh = model.kv_latent(1, x[reused])
        old = cache.layer(1).kv_lat[positions[reused]]
        deviation = np.linalg.norm(fresh - old, axis=1) / (np.linalg.norm(old, axis=1) + 1e-6)
        keep[reused[np.argsort(-deviation, kind="stable")[:count]]] = True
    x, positions = x[keep], positions[keep]
    chosen = None if chosen is None else chosen[keep]
    if not len(positions):
        return x, positions
    for layer in range(1, model.config.num_hidden_layers):
        x, chosen = model.decoder_layer(layer, x, positions, cache.layer(layer), chosen)
    return model.final_norm(x), positions


def reserve(cache: KVCache, n: int) -> None:
    """Append `n` zero rows to every main layer (placeholders that `forward_at` or an import overwrites)."""
    for layer in cache.layers[:cache.num_main_layers]:
        layer.append(**{name: np.zeros((n, layer.width(name)), np.float32)
                        for name in ("kv_lat", "k_rot", "index_k") if name != "index_k" or layer.has_index})
