"""GLM-5's layers described once: which stages each decoder layer has, the tensors they read, their constants.

`GlmMoeDsaModel` (glmkit.model.glm5) runs these stages through a `Backend`, the reference; the OpenCL decode step
(glmkit.backends.opencl.decode_graph) binds the same stages to fused kernels. Neither names a tensor, an epsilon, a
scale or a layer's choice of stages itself: both read them here, so a change to the layer is made in one place and a
stage the decode step cannot bind is refused there (the per-operation path runs then) rather than skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from glmkit.format.config import ModelConfig
from glmkit.format.schema import EXPERT_PROJECTIONS, expert_weight_name, layer_prefix
from glmkit.model.ops import LATENT_NORM_EPS

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class NormSpec:
    """An RMSNorm of weight `weight`, or a LayerNorm when it has a `bias`; both over the last axis."""

    weight: str
    eps: float
    bias: str | None = None


@dataclass(frozen=True)
class MLPSpec:
    """`down(silu(gate x) * up x)`: a dense layer's MLP, the shared expert or one routed expert."""

    gate: str
    up: str
    down: str

    @classmethod
    def at(cls, prefix: str) -> MLPSpec:
        """The MLP whose tensors are `{prefix}{gate,up,down}_proj.weight`."""
        return cls(*(f"{prefix}{projection}.weight" for projection in EXPERT_PROJECTIONS))

    @property
    def names(self) -> tuple[str, str, str]:
        return self.gate, self.up, self.down


@dataclass(frozen=True)
class IndexerSpec:
    """DSA's lightning indexer: key `LayerNorm(wk u)`, queries `wq_b q_lat` (`n_heads` of `head_dim`), head weights
    `weights_proj u * head_scale`; scores `sum_h w_h relu(q_h . k * score_scale)`, the `topk` best keys kept."""

    wk: str
    key_norm: NormSpec
    wq_b: str
    weights_proj: str
    n_heads: int
    head_dim: int
    head_scale: float
    score_scale: float
    topk: int


Selection = Literal["indexer", "previous", "causal"]
"""The keys a layer attends to: its indexer's top-k (every causal key while there are at most `topk`), the previous
layer's selection (DSA 'shared' layers), or every causal key."""


@dataclass(frozen=True)
class AttentionSpec:
    """MLA: `q = q_b(RMSNorm(q_a u))` per head `[nope | rope]`; `kv_a u = [kv_lat | k_rot]`, `kv_lat` normed and
    cached; `kv_b` lifts the latent to per-head `[k_nope | v]`; `o_proj` of the heads' values. `scale` multiplies the
    query-key products; RoPE angles from `rope_theta` over `rope` dims."""

    q_a: str
    q_a_norm: NormSpec
    q_b: str
    kv_a: str
    kv_a_norm: NormSpec
    kv_b: str
    o_proj: str
    heads: int
    nope: int
    rope: int
    v_dim: int
    kv_lora: int
    scale: float
    rope_theta: float
    selection: Selection
    indexer: IndexerSpec | None  # present exactly when selection is "indexer"


@dataclass(frozen=True)
class RouterSpec:
    """noaux_tc routing: sigmoid scores of `weight u`, `bias` added for the choice only, `top_k` experts from the
    best `topk_group` of `n_group` groups; weights renormalized when `norm_topk_prob`, times `scaling`."""

    weight: str
    bias: str
    n_experts: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    scaling: float


@dataclass(frozen=True)
class MoESpec:
    """A MoE feed-forward: routed experts (`expert(e)`) weighted by the router, plus the shared expert if any."""

    layer: int
    router: RouterSpec
    shared: MLPSpec | None

    def expert(self, e: int) -> MLPSpec:
        return MLPSpec(*(expert_weight_name(self.layer, e, projection) for projection in EXPERT_PROJECTIONS))


@dataclass(frozen=True)
class LayerSpec:
    """Decoder layer `index`: `h = x + Attn(input_norm(x))`, `x' = h + FFN(post_attention_norm(h))`."""

    index: int
    input_norm: NormSpec
    attention: AttentionSpec
    post_attention_norm: NormSpec
    ffn: MLPSpec | MoESpec

    def vectors(self) -> list[str]:
        """Every 1-D tensor the layer reads (norm weights and biases, the router's bias)."""
        a = self.attention
        norms = [self.input_norm, self.post_attention_norm, a.q_a_norm, a.kv_a_norm]
        if a.indexer is not None:
            norms.append(a.indexer.key_norm)
        names = [n for norm in norms for n in (norm.weight, norm.bias) if n is not None]
        if isinstance(self.ffn, MoESpec):
            names.append(self.ffn.router.bias)
        return names

    def matrices(self) -> list[str]:
        """Every 2-D tensor the layer reads but its MLPs' (attention's, the indexer's, the router's)."""
        a = self.attention
        names = [a.q_a, a.q_b, a.kv_a, a.kv_b, a.o_proj]
        if a.indexer is not None:
            names += [a.indexer.wk, a.indexer.wq_b, a.indexer.weights_proj]
        if isinstance(self.ffn, MoESpec):
            names.append(self.ffn.router.weight)
        return names


@dataclass(frozen=True)
class MTPSpec:
    """The MTP head before its decoder layer: `eh_proj([enorm(emb(t_next)) ; hnorm(h)])`; after it
    `head_norm`, then the main lm_head."""

    enorm: NormSpec
    hnorm: NormSpec
    eh_proj: str
    head_norm: NormSpec


def layer_spec(cfg: ModelConfig, layer: int, has: Callable[[str], bool]) -> LayerSpec:
    """Layer `layer` (the MTP layer at `num_hidden_layers`) of a model whose tensors `has(name)` tells: a main 'full'
    layer always has an indexer; an MTP layer shipped without indexer weights attends to every causal key."""
    p = layer_prefix(layer)
    a = p + "self_attn."
    full = cfg.indexer_type(layer) == "full"
    indexer = None
    if full and (layer < cfg.num_hidden_layers or has(a + "indexer.wk.weight")):
        i = a + "indexer."
        indexer = IndexerSpec(i + "wk.weight", NormSpec(i + "k_norm.weight", LATENT_NORM_EPS, i + "k_norm.bias"),
                              i + "wq_b.weight", i + "weights_proj.weight", cfg.index_n_heads, cfg.index_head_dim,
                              cfg.index_n_heads ** -0.5, cfg.index_head_dim ** -0.5, cfg.index_topk)
    selection: Selection = "indexer" if indexer is not None else "causal" if full else "previous"
    attention = AttentionSpec(
        a + "q_a_proj.weight", NormSpec(a + "q_a_layernorm.weight", LATENT_NORM_EPS), a + "q_b_proj.weight",
        a + "kv_a_proj_with_mqa.weight", NormSpec(a + "kv_a_layernorm.weight", LATENT_NORM_EPS), a + "kv_b_proj.weight",
        a + "o_proj.weight", cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
        cfg.kv_lora_rank, cfg.qk_head_dim ** -0.5, cfg.rope_theta, selection, indexer)
    ffn: MLPSpec | MoESpec = MLPSpec.at(p + "mlp.")
    if cfg.is_moe_layer(layer):
        router = RouterSpec(p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias", cfg.n_routed_experts,
                            cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                            cfg.routed_scaling_factor)
        ffn = MoESpec(layer, router, MLPSpec.at(p + "mlp.shared_experts.") if cfg.n_shared_experts else None)
    return LayerSpec(layer, NormSpec(p + "input_layernorm.weight", cfg.rms_norm_eps), attention,
                     NormSpec(p + "post_attention_layernorm.weight", cfg.rms_norm_eps), ffn)


def final_norm_spec(cfg: ModelConfig) -> NormSpec:
    """The main model's norm after its last layer (the lm_head's and the MTP head's input)."""
    return NormSpec("model.norm.weight", cfg.rms_norm_eps)


def mtp_spec(cfg: ModelConfig) -> MTPSpec:
    """The MTP head's own tensors (its decoder layer is `layer_spec(cfg, cfg.num_hidden_layers, ...)`)."""
    p = layer_prefix(cfg.num_hidden_layers)
    eps = cfg.rms_norm_eps
    return MTPSpec(NormSpec(p + "enorm.weight", eps), NormSpec(p + "hnorm.weight", eps), p + "eh_proj.weight",
                   NormSpec(p + "shared_head.norm.weight", eps))
