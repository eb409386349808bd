"""The GLM-5 (`glm_moe_dsa`) forward pass: MLA attention with the DSA indexer, noaux_tc MoE, MTP.

Math follows DESIGN section 3 (transformers 5.23.0, float32). Rows are vectors and `W` is `[out, in]`:
`y = x W^T`. The small pure functions below are the paper's equations; `GlmMoeDsaModel` wires them to
a weight source (Hugging Face tensor names) and a `Backend` that does the heavy lifting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from glmkit.errors import GlmkitError
from glmkit.format.config import ModelConfig
from glmkit.format.tensors import Weight
from glmkit.model.compute import Backend, DecodeStep, GreedyDecode, Routes
from glmkit.model.kv_cache import KVCache, LayerKV
from glmkit.model.ops import LATENT_NORM_EPS, causal_mask, embed_rows, rope_cos_sin, route_noaux_tc


class WeightSource(Protocol):
    """Tensors by Hugging Face name; f32 arrays are read-only views, 1-D tensors always f32 arrays."""

    def weight(self, name: str) -> Weight: ...

    def has(self, name: str) -> bool: ...


RouteHook = Callable[[int, np.ndarray, np.ndarray | None], None]
"""Called as `hook(layer, expert_ids [S, k], normed_input [S, H])` right after routing, before any expert runs;
after a device decode step, as `hook(layer, expert_ids [1, k], None)` once the token ran."""


# ---- pure functions ----------------------------------------------------------------------------

def mla_attend_full(backend: Backend, q_nope: np.ndarray, q_rot: np.ndarray, kv_lat: np.ndarray,
                    k_rot: np.ndarray, kv_b: Weight, allowed: np.ndarray, scale: float) -> np.ndarray:
    """MLA by reconstruction: `kv = kv_lat Wkv_b^T` per head `[k_nope | v]`; returns `[S, nh, v]`.

    q_nope `[S, nh, nope]`, q_rot `[S, nh, rope]` (roped), kv_lat `[T, kvl]`, k_rot `[T, rope]` (roped).
    """
    total = kv_lat.shape[0]
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    kv = backend.linear(kv_lat, kv_b).reshape(total, heads, -1)
    keys = np.concatenate([kv[..., :nope], np.broadcast_to(k_rot[:, None, :], (total, heads, k_rot.shape[1]))],
                          axis=-1)
    return backend.attention(np.concatenate([q_nope, q_rot], axis=-1), keys, kv[..., nope:], allowed, scale)


def mla_attend_absorbed(backend: Backend, q_nope: np.ndarray, q_rot: np.ndarray, kv_lat: np.ndarray,
                        k_rot: np.ndarray, kv_b: Weight, allowed: np.ndarray, scale: float) -> np.ndarray:
    """MLA with `kv_b` absorbed (same math as `mla_attend_full`, no per-key reconstruction).

    `q_nope . (Wk_b kv_lat) = (q_nope Wk_b) . kv_lat`, so queries move into latent space and attend one
    shared key head `[kv_lat | k_rot]`; the weighted sum of `kv_lat` is lifted by `Wv_b` afterwards.
    """
    nope = q_nope.shape[2]
    v_dim = kv_b.shape[0] // q_nope.shape[1] - nope
    q_lat = backend.head_matmul(q_nope, kv_b, 0, nope, transpose=True)  # [S, nh, kvl]
    keys = np.concatenate([kv_lat, k_rot], axis=-1)[:, None, :]  # [T, 1, kvl + rope]
    o_lat = backend.attention(np.concatenate([q_lat, q_rot], axis=-1), keys, kv_lat[:, None, :], allowed, scale)
    return backend.head_matmul(o_lat, kv_b, nope, v_dim, transpose=False)  # [S, nh, v]


# ---- the model ---------------------------------------------------------------------------------

@dataclass
class AttentionInputs:
    """What one layer's attention computes from its normed input before it looks at the cache (S rows):
    `q_nope [S, nh, nope]`, `q_rot [S, nh, rope]` (roped), `kv_lat [S, kv_lora]` (normed), `k_rot [S, rope]`
    (roped); DSA layers: `index_k [S, ihd]`, and when scores are needed `index_q [S, inh, ihd]` and
    `index_weights [S, inh]` (scaled by `inh^-1/2`)."""

    q_nope: np.ndarray
    q_rot: np.ndarray
    kv_lat: np.ndarray
    k_rot: np.ndarray
    index_k: np.ndarray | None = None
    index_q: np.ndarray | None = None
    index_weights: np.ndarray | None = None


class GlmMoeDsaModel:
    """GLM-5 forward over a weight source and a backend.

    absorb_max_rows: calls appending at most this many tokens to a non-empty cache use the absorbed
    MLA path (decode, MTP verification); others reconstruct keys and values (prefill).
    route_hook: optional `hook(layer, expert_ids [S, k], u [S, H])` (hit/miss counting, prefetch).
    """

    def __init__(self, config: ModelConfig, weights: WeightSource, backend: Backend,
                 absorb_max_rows: int = 4, route_hook: RouteHook | None = None,
                 step_route_hook: Callable[[int, np.ndarray], None] | None = None) -> None:
        self.config = config
        self.weights = weights
        self.backend = backend
        self.absorb_max_rows = absorb_max_rows
        self.route_hook = route_hook
        self.step_route_hook = step_route_hook  # a decode step's routing as it happens: `DecodeStep.watch_routes`
        self._step: DecodeStep | None | bool = False  # the backend's decode step, asked for on first decode

    def _w(self, name: str) -> Weight:
        return self.weights.weight(name)

    def _has_indexer(self, layer: int) -> bool:
        return self.weights.has(f"model.layers.{layer}.self_attn.indexer.wk.weight")

    @property
    def has_mtp(self) -> bool:
        """True when the weights include the MTP layer (index num_hidden_layers)."""
        return self.config.num_nextn_predict_layers > 0 and self.weights.has(
            f"model.layers.{self.config.num_hidden_layers}.eh_proj.weight")

    def new_cache(self) -> KVCache:
        """An empty cache; indexer keys are kept on every layer that has indexer weights."""
        layers = range(self.config.num_layers_with_mtp)
        return KVCache(self.config, index_layers=[i for i in layers if self._has_indexer(i)])

    # ---- entry points --------------------------------------------------------------------------

    def forward(self, token_ids: np.ndarray, cache: KVCache, last_logits_only: bool = False
                ) -> tuple[np.ndarray, np.ndarray]:
        """Append `token_ids [S]` at positions `cache.length..` and run the main model.

        Returns (logits `[S, V]`, or `[1, V]` for the last position with `last_logits_only`;
        hidden `[S, H]` after the final norm, the input the MTP layer needs).
        """
        x = embed_rows(self._w("model.embed_tokens.weight"), np.asarray(token_ids))
        if len(token_ids) == 1 and cache.length > 0 and self._decode_step() is not None:
            return self._device_decode(int(token_ids[0]), x[0], cache)
        allowed = None  # the most recent 'full' layer's DSA selection [S, T], reused by 'shared' layers
        for layer in range(self.config.num_hidden_layers):
            x, allowed = self._decoder_layer(layer, x, cache.layer(layer), allowed)
        hidden = self.backend.rms_norm(x, self._w("model.norm.weight"), self.config.rms_norm_eps)
        head_in = hidden[-1:] if last_logits_only else hidden
        logits = self.backend.linear(head_in, self._w("lm_head.weight"))
        if len(token_ids) > self.absorb_max_rows:
            self.backend.release_memory()  # a prefill's temporaries are freed; decode should not carry them
        return logits, hidden

    def decodes_on_device(self) -> bool:
        """Whether a single-token forward runs as the backend's decode step (e.g. OpenCL on a CPU device)."""
        return self._decode_step() is not None

    def _decode_step(self) -> DecodeStep | None:
        if self._step is False:
            self._step = self.backend.decode_step(self.config, self._w)
            if self._step is not None and self.step_route_hook is not None:
                self._step.watch_routes(self.step_route_hook)
        return self._step

    def _device_decode(self, token: int, embed: np.ndarray, cache: KVCache) -> tuple[np.ndarray, np.ndarray]:
        """One decoded token through the backend's decode step; the route hook sees each layer's experts after
        the token ran (no normed input: nothing is left to prefetch for)."""
        logits, hidden, routes = self._step(token, cache, embed)
        self._report_routes(routes)
        return logits, hidden

    def _report_routes(self, routes: Routes) -> None:
        """Hand the route hook the experts a device decode step chose, after the token ran."""
        if self.route_hook is not None:
            for layer, ids in routes:
                self.route_hook(layer, ids, None)

    def greedy_decode(self, token: int, cache: KVCache) -> GreedyDecode | None:
        """Greedy decoding from `token` (appended next) with the following forward queued before the host sees
        each token (the backend's decode step), or None: the caller then decodes with `forward`."""
        step = self._decode_step() if cache.length > 0 else None
        if step is None:
            return None
        table = self._w("model.embed_tokens.weight")
        return step.greedy(token, cache, lambda t: embed_rows(table, np.array([t]))[0], self._report_routes)

    def mtp_forward(self, hidden: np.ndarray, next_token_ids: np.ndarray, cache: KVCache
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Multi-token prediction: draft logits for the token after each `next_token_ids[i]`.

        hidden `[S, H]`: the main model's post-final-norm states at positions p..p+S-1 (p = the MTP
        layer's cache length); next_token_ids `[S]`: the tokens at positions p+1..p+S.
        `h' = eh_proj([enorm(emb(t_{i+1})) ; hnorm(h_i)])` (embedding first), then the MTP decoder layer
        at position i, `shared_head.norm` and the main `lm_head`.
        Returns (logits `[S, V]`, the MTP layer's output `[S, H]` before `shared_head.norm`).
        """
        cfg, b = self.config, self.backend
        if cfg.num_nextn_predict_layers == 0:
            raise GlmkitError("this model has no MTP layer (num_nextn_predict_layers is 0)")
        layer = cfg.num_hidden_layers
        prefix = f"model.layers.{layer}."
        emb = embed_rows(self._w("model.embed_tokens.weight"), np.asarray(next_token_ids))
        joined = np.concatenate([b.rms_norm(emb, self._w(prefix + "enorm.weight"), cfg.rms_norm_eps),
                                 b.rms_norm(hidden, self._w(prefix + "hnorm.weight"), cfg.rms_norm_eps)], axis=-1)
        x = b.linear(joined, self._w(prefix + "eh_proj.weight"))
        x, _ = self._decoder_layer(layer, x, cache.layer(layer), None)
        normed = b.rms_norm(x, self._w(prefix + "shared_head.norm.weight"), cfg.rms_norm_eps)
        return b.linear(normed, self._w("lm_head.weight")), x

    # ---- one decoder layer ---------------------------------------------------------------------

    def _decoder_layer(self, layer: int, x: np.ndarray, kv: LayerKV, prev_allowed: np.ndarray | None
                       ) -> tuple[np.ndarray, np.ndarray]:
        """`h = x + Attn(RMSNorm(x))`; `x' = h + FFN(RMSNorm(h))`. Returns (x' `[S, H]`, DSA selection)."""
        cfg, b = self.config, self.backend
        prefix = f"model.layers.{layer}."
        attn, allowed = self._attention(layer, b.rms_norm(x, self._w(prefix + "input_layernorm.weight"),
                                                          cfg.rms_norm_eps), kv, prev_allowed)
        h = x + attn
        u = b.rms_norm(h, self._w(prefix + "post_attention_layernorm.weight"), cfg.rms_norm_eps)
        ffn = self._moe(layer, u) if cfg.is_moe_layer(layer) else self._mlp(prefix + "mlp.", u)
        return h + ffn, allowed

    def _attention(self, layer: int, u: np.ndarray, kv: LayerKV, prev_allowed: np.ndarray | None
                   ) -> tuple[np.ndarray, np.ndarray]:
        """MLA + DSA on normed input `u [S, H]`; appends this layer's cache rows.

        Returns (output `[S, H]`, the selection `[S, T]` this layer attended with).
        """
        cfg, b = self.config, self.backend
        prefix = f"model.layers.{layer}.self_attn."
        seq, start = u.shape[0], kv.length
        cos, sin = rope_cos_sin(np.arange(start, start + seq), cfg.qk_rope_head_dim, cfg.rope_theta)

        # Main 'full' layers must have indexer weights; an MTP layer shipped without them attends densely.
        indexed = cfg.indexer_type(layer) == "full" and (layer < cfg.num_hidden_layers or self._has_indexer(layer))
        scored = indexed and start + seq > cfg.index_topk  # with at most index_topk keys, all are kept: no scores
        a = self.attention_inputs(prefix, u, cos, sin, indexed, scored)
        rows = {"kv_lat": a.kv_lat, "k_rot": a.k_rot}
        if indexed:
            rows["index_k"] = a.index_k
        kv.append(**rows)
        allowed = self.select_keys(layer, a, kv, causal_mask(start, seq, kv.length), prev_allowed)

        scale = cfg.qk_head_dim ** -0.5
        absorb = 0 < start and seq <= self.absorb_max_rows
        attend = mla_attend_absorbed if absorb else mla_attend_full
        out = attend(b, a.q_nope, a.q_rot, kv.kv_lat, kv.k_rot, self._w(prefix + "kv_b_proj.weight"), allowed, scale)
        return b.linear(out.reshape(seq, -1), self._w(prefix + "o_proj.weight")), allowed

    def attention_inputs(self, prefix: str, u: np.ndarray, cos: np.ndarray, sin: np.ndarray, indexed: bool,
                         scored: bool) -> AttentionInputs:
        """Every projection attention needs from its normed input `u [S, H]` (see `AttentionInputs`); the indexer
        key when `indexed`, its queries and head weights when `scored`."""
        cfg, b = self.config, self.backend
        seq, heads, nope, rope_dim = u.shape[0], cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q_lat = b.rms_norm(b.linear(u, self._w(prefix + "q_a_proj.weight")),
                           self._w(prefix + "q_a_layernorm.weight"), LATENT_NORM_EPS)
        q = b.linear(q_lat, self._w(prefix + "q_b_proj.weight")).reshape(seq, heads, nope + rope_dim)
        compressed = b.linear(u, self._w(prefix + "kv_a_proj_with_mqa.weight"))
        kv_lat = b.rms_norm(compressed[:, : cfg.kv_lora_rank], self._w(prefix + "kv_a_layernorm.weight"),
                            LATENT_NORM_EPS)
        inputs = AttentionInputs(q[..., :nope], b.rope(q[..., nope:], cos, sin), kv_lat,  # main attention: LAST dims
                                 b.rope(compressed[:, cfg.kv_lora_rank:], cos, sin))
        if indexed:  # indexer: LayerNorm with bias on the key, rope on the FIRST rope dims
            key = b.layer_norm(b.linear(u, self._w(prefix + "indexer.wk.weight")),
                               self._w(prefix + "indexer.k_norm.weight"), self._w(prefix + "indexer.k_norm.bias"),
                               LATENT_NORM_EPS)
            inputs.index_k = np.concatenate([b.rope(key[:, :rope_dim], cos, sin), key[:, rope_dim:]], axis=-1)
        if scored:
            iq = b.linear(q_lat, self._w(prefix + "indexer.wq_b.weight")).reshape(seq, cfg.index_n_heads,
                                                                                 cfg.index_head_dim)
            inputs.index_q = np.concatenate([b.rope(iq[..., :rope_dim], cos, sin), iq[..., rope_dim:]], axis=-1)
            head_weights = b.linear(u, self._w(prefix + "indexer.weights_proj.weight"))
            inputs.index_weights = head_weights * np.float32(cfg.index_n_heads ** -0.5)
        return inputs

    def select_keys(self, layer: int, inputs: AttentionInputs, kv: LayerKV, causal: np.ndarray,
                    prev_allowed: np.ndarray | None) -> np.ndarray:
        """The keys `[S, T]` a layer attends to: DSA's top-k when its indexer scored (`inputs.index_q`, against all
        cached indexer keys), the previous layer's selection on a 'shared' layer, else every causal key."""
        cfg = self.config
        if inputs.index_q is not None:
            assert inputs.index_weights is not None
            return self.backend.index_topk(inputs.index_q, kv.index_k, inputs.index_weights,
                                           cfg.index_head_dim ** -0.5, causal, cfg.index_topk)
        if cfg.indexer_type(layer) == "shared":
            return prev_allowed  # type: ignore[return-value]  # the previous layer's top-k, reused
        return causal

    # ---- feed-forward --------------------------------------------------------------------------

    def _mlp_weights(self, prefix: str) -> tuple[Weight, Weight, Weight]:
        return (self._w(prefix + "gate_proj.weight"), self._w(prefix + "up_proj.weight"),
                self._w(prefix + "down_proj.weight"))

    def _mlp(self, prefix: str, u: np.ndarray) -> np.ndarray:
        return self.backend.expert_mlp(u, *self._mlp_weights(prefix))

    def _moe(self, layer: int, u: np.ndarray) -> np.ndarray:
        """Routed experts (batch-union) plus the shared expert, on `u [S, H]`."""
        cfg = self.config
        prefix = f"model.layers.{layer}.mlp."
        logits = self.backend.linear(u, self._w(prefix + "gate.weight"))
        ids, weights = route_noaux_tc(logits, self._w(prefix + "gate.e_score_correction_bias"),
                                      cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                                      cfg.norm_topk_prob, cfg.routed_scaling_factor)
        if self.route_hook is not None:
            self.route_hook(layer, ids, u)
        return self.backend.moe(u, ids, weights, lambda e: self._mlp_weights(f"{prefix}experts.{e}."),
                                self._mlp_weights(prefix + "shared_experts."))
