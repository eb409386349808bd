"""Recompute KV rows at chosen positions in place (CacheBlend-style), for approximate prefill reuse.

`model.forward` appends a contiguous block of tokens at the end of the cache. Approximate reuse needs more: the
cache already holds rows at every position (imported from chunks stored elsewhere, or placeholders), and a
SET of positions - the gaps between reused spans and the reused spans' first tokens - must be computed, each
attending to every row at or before its own position. Done left to right with `forward`, that costs one
forward per gap; here it is one pass: per layer, the rows of all chosen positions are computed and written
first, then their queries attend under a by-position causal mask. Every position therefore sees exactly what
a left-to-right build would have shown it.

The decoder math is `GlmMoeDsaModel`'s (same weights, same backend calls, the feed-forward and DSA selection
methods reused as they are); only the attention wiring differs (explicit positions instead of `cache.length`).
`tests/test_semantic_reuse.py` checks that recomputing a contiguous block this way equals `model.forward`.
"""

from __future__ import annotations

import numpy as np

from glmkit.model.glm5 import GlmMoeDsaModel, mla_attend_full
from glmkit.model.kv_cache import KVCache, LayerKV
from glmkit.model.ops import LATENT_NORM_EPS, embed_rows, rope_cos_sin


def forward_at(model: GlmMoeDsaModel, token_ids: np.ndarray, positions: np.ndarray, cache: KVCache) -> np.ndarray:
    """Recompute, in every main layer, the rows of `token_ids` at `positions` (strictly increasing, each below the
    cache length) against all cached rows at or before each position; returns the post-final-norm hidden
    states `[S, H]` of those positions. The MTP layer is not touched."""
    cfg, b = model.config, model.backend
    positions = np.asarray(positions, dtype=np.int64)
    x = embed_rows(model.weights.weight("model.embed_tokens.weight"), np.asarray(token_ids, dtype=np.int64))
    allowed = None
    for layer in range(cfg.num_hidden_layers):
        x, allowed = _decoder_layer_at(model, layer, x, positions, cache.layer(layer), allowed)
    return b.rms_norm(x, model.weights.weight("model.norm.weight"), cfg.rms_norm_eps)


def blend_forward(model: GlmMoeDsaModel, token_ids: np.ndarray, positions: np.ndarray, cache: KVCache,
                  imported: np.ndarray, ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """CacheBlend's selective recompute over `positions` (strictly increasing, below the cache length), of which
    `imported` (bool mask) hold reused rows and the rest must be computed.

    Layer 0 is computed for every position (its rows depend on the token alone, so reused ones do not change).
    Then each reused position's layer-1 `kv_lat` is recomputed from that layer-0 output and compared with the
    reused row; the `ratio` fraction of reused positions that deviate most join the computed ones for layers 1
    and up, the others keep their reused rows. Returns (post-final-norm hidden states of the computed positions,
    those positions)."""
    cfg, b, w = model.config, model.backend, model.weights.weight
    positions = np.asarray(positions, dtype=np.int64)
    x = embed_rows(w("model.embed_tokens.weight"), np.asarray(token_ids, dtype=np.int64))
    x, allowed = _decoder_layer_at(model, 0, x, positions, cache.layer(0), None)
    keep = ~np.asarray(imported, dtype=bool)
    reused = np.flatnonzero(~keep)
    count = min(len(reused), int(np.ceil(ratio * len(reused) - 1e-9)))
    if count and cfg.num_hidden_layers > 1:
        u = b.rms_norm(x[reused], w("model.layers.1.input_layernorm.weight"), cfg.rms_norm_eps)
        c = b.linear(u, w("model.layers.1.self_attn.kv_a_proj_with_mqa.weight"))
        fresh = b.rms_norm(c[:, :cfg.kv_lora_rank], w("model.layers.1.self_attn.kv_a_layernorm.weight"),
                           LATENT_NORM_EPS)
        old = cache.layer(1).kv_lat[positions[reused]]
        deviation = np.linalg.norm(fresh - old, axis=1) / (np.linalg.norm(old, axis=1) + 1e-6)
        keep[reused[np.argsort(-deviation, kind="stable")[:count]]] = True
    x, positions, allowed = x[keep], positions[keep], allowed[keep]
    if not len(positions):
        return x, positions
    for layer in range(1, cfg.num_hidden_layers):
        x, allowed = _decoder_layer_at(model, layer, x, positions, cache.layer(layer), allowed)
    return b.rms_norm(x, w("model.norm.weight"), cfg.rms_norm_eps), positions


def _decoder_layer_at(model: GlmMoeDsaModel, layer: int, x: np.ndarray, positions: np.ndarray, kv: LayerKV,
                      prev_allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    cfg, b, w = model.config, model.backend, model.weights.weight
    prefix = f"model.layers.{layer}."
    u = b.rms_norm(x, w(prefix + "input_layernorm.weight"), cfg.rms_norm_eps)
    attn, allowed = _attention_at(model, layer, u, positions, kv, prev_allowed)
    h = x + attn
    u = b.rms_norm(h, w(prefix + "post_attention_layernorm.weight"), cfg.rms_norm_eps)
    ffn = model._moe(layer, u) if cfg.is_moe_layer(layer) else model._mlp(prefix + "mlp.", u)
    return h + ffn, allowed


def _attention_at(model: GlmMoeDsaModel, layer: int, u: np.ndarray, positions: np.ndarray, kv: LayerKV,
                  prev_allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """`GlmMoeDsaModel._attention` with rows written at `positions` instead of appended."""
    cfg, b, w = model.config, model.backend, model.weights.weight
    prefix = f"model.layers.{layer}.self_attn."
    seq = u.shape[0]
    cos, sin = rope_cos_sin(positions, cfg.qk_rope_head_dim, cfg.rope_theta)
    indexed = cfg.indexer_type(layer) == "full"
    scored = indexed and kv.length > cfg.index_topk
    a = model.attention_inputs(prefix, u, cos, sin, indexed, scored)
    kv.rows("kv_lat")[positions] = a.kv_lat
    kv.rows("k_rot")[positions] = a.k_rot
    if indexed:
        kv.rows("index_k")[positions] = a.index_k
    allowed = model.select_keys(layer, a, kv, np.arange(kv.length)[None, :] <= positions[:, None], prev_allowed)
    out = mla_attend_full(b, a.q_nope, a.q_rot, kv.kv_lat, kv.k_rot, w(prefix + "kv_b_proj.weight"), allowed,
                          cfg.qk_head_dim ** -0.5)
    return b.linear(out.reshape(seq, -1), w(prefix + "o_proj.weight")), allowed


def reserve(cache: KVCache, n: int) -> None:
    """Append `n` zero rows to every main layer (placeholders that `forward_at` or an import overwrites)."""
    for layer in cache.layers[:cache.num_main_layers]:
        layer.append(**{name: np.zeros((n, layer.rows(name).shape[1]), np.float32)
                        for name in ("kv_lat", "k_rot", "index_k") if name != "index_k" or layer.has_index})
