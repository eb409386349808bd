"""Which tensors a `glm_moe_dsa` model has, their logical shapes and roles (DESIGN section 2).

Routed experts are always listed per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`); a
converter reading a fused export splits them. The MTP layer sits at index `num_hidden_layers`.
"""

from __future__ import annotations

from dataclasses import dataclass

from glmkit.format.config import ModelConfig

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    role: str
    layer: int | None = None  # decoder layer index (MTP included), None for global tensors
    expert: int | None = None  # routed expert index


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def tensor_layer(name: str) -> int | None:
    """The decoder layer (MTP included) a tensor name belongs to, or None for a global tensor (embed, norm, lm_head)."""
    if not name.startswith("model.layers."):
        return None
    index = name.split(".", 3)[2]
    return int(index) if index.isdigit() else None


def expert_weight_name(layer: int, expert: int, projection: str) -> str:
    return f"{layer_prefix(layer)}mlp.experts.{expert}.{projection}.weight"


def model_tensors(cfg: ModelConfig, include_mtp: bool = True) -> list[TensorSpec]:
    """Every tensor of the model in container order: embed, layers (experts grouped), norm, lm_head."""
    specs = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), "embed")]
    layers = cfg.num_layers_with_mtp if include_mtp else cfg.num_hidden_layers
    for layer in range(layers):
        specs.extend(_layer_tensors(cfg, layer))
    specs.append(TensorSpec("model.norm.weight", (cfg.hidden_size,), "norm"))
    specs.append(TensorSpec("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), "lm_head"))
    return specs


def _layer_tensors(cfg: ModelConfig, layer: int) -> list[TensorSpec]:
    h = cfg.hidden_size
    nh = cfg.num_attention_heads
    is_mtp = layer >= cfg.num_hidden_layers
    p = layer_prefix(layer)
    out: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], role: str, expert: int | None = None) -> None:
        if len(shape) == 1:
            role = "norm"  # every 1-D tensor (norm weights, biases) is kept in F32
        elif is_mtp and role not in ("routed_expert", "router"):
            role = "mtp"
        out.append(TensorSpec(p + name, shape, role, layer, expert))

    if is_mtp:
        add("eh_proj.weight", (h, 2 * h), "mtp")
        add("enorm.weight", (h,), "norm")
        add("hnorm.weight", (h,), "norm")
        add("shared_head.norm.weight", (h,), "norm")
    add("input_layernorm.weight", (h,), "norm")
    add("post_attention_layernorm.weight", (h,), "norm")
    a = "self_attn."
    add(a + "q_a_proj.weight", (cfg.q_lora_rank, h), "attention")
    add(a + "q_a_layernorm.weight", (cfg.q_lora_rank,), "norm")
    add(a + "q_b_proj.weight", (nh * cfg.qk_head_dim, cfg.q_lora_rank), "attention")
    add(a + "kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h), "attention")
    add(a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,), "norm")
    add(a + "kv_b_proj.weight", (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), "attention")
    add(a + "o_proj.weight", (h, nh * cfg.v_head_dim), "attention")
    if cfg.indexer_type(layer) == "full":
        i = a + "indexer."
        add(i + "wq_b.weight", (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank), "indexer")
        add(i + "wk.weight", (cfg.index_head_dim, h), "indexer")
        add(i + "k_norm.weight", (cfg.index_head_dim,), "norm")
        add(i + "k_norm.bias", (cfg.index_head_dim,), "norm")
        add(i + "weights_proj.weight", (cfg.index_n_heads, h), "indexer")
    if not cfg.is_moe_layer(layer):
        for proj, shape in _mlp_shapes(h, cfg.intermediate_size).items():
            add(f"mlp.{proj}.weight", shape, "dense_mlp")
        return out
    add("mlp.gate.weight", (cfg.n_routed_experts, h), "router")
    add("mlp.gate.e_score_correction_bias", (cfg.n_routed_experts,), "norm")
    if cfg.n_shared_experts:
        shared = _mlp_shapes(h, cfg.moe_intermediate_size * cfg.n_shared_experts)
        for proj, shape in shared.items():
            add(f"mlp.shared_experts.{proj}.weight", shape, "shared_expert")
    for e in range(cfg.n_routed_experts):
        for proj, shape in _mlp_shapes(h, cfg.moe_intermediate_size).items():
            add(f"mlp.experts.{e}.{proj}.weight", shape, "routed_expert", expert=e)
    return out


def _mlp_shapes(hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    return {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
