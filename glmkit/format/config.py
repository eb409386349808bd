"""`ModelConfig`: the checked subset of a `glm_moe_dsa` config.json that glmkit reads.

config.json is untrusted input (read through `files.read_json_file`): every dimension is checked against a sane
bound before anything is sized from it, so a hostile file fails here with a message instead of allocating terabytes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from glmkit.errors import GlmkitError
from glmkit.format.files import read_json_file

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa",)

# Upper bounds well above GLM-5's real values (hidden 6144, 256 experts, vocab 154880, ...).
_MAX_DIM = 1 << 17
_MAX_LAYERS = 1024
_MAX_EXPERTS = 4096
_MAX_VOCAB = 1 << 22
_MAX_POSITIONS = 1 << 24
# routed-expert matrices over all layers (GLM-5: 79 x 256): bounds the tensor list planned from a config
_MAX_EXPERT_LAYERS = 1 << 18
_MAX_EOS_IDS = 64

MAX_CONFIG_BYTES = 16 << 20


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters (names follow transformers' GlmMoeDsaConfig)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    indexer_types: tuple[str, ...]
    num_nextn_predict_layers: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_layers_with_mtp(self) -> int:
        """Main layers plus the MTP layer(s), which sit at indices num_hidden_layers.. in the checkpoint."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def indexer_type(self, layer: int) -> str:
        """'full' (own indexer) or 'shared' (reuses the last full layer's top-k). MTP layers are full."""
        if layer >= self.num_hidden_layers:
            return "full"
        return self.indexer_types[layer]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.exists() and not path.is_symlink():
            raise GlmkitError(f"{path}: config.json not found")
        raw = read_json_file(path, MAX_CONFIG_BYTES)
        if not isinstance(raw, dict):
            raise GlmkitError(f"{path}: config must be a JSON object")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type is None:
            raise GlmkitError(f"{source}: missing 'model_type' (expected one of {SUPPORTED_MODEL_TYPES})")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise GlmkitError(f"{source}: unsupported model_type {model_type!r} (glmkit runs {SUPPORTED_MODEL_TYPES})")

        def get_int(key: str, lo: int, hi: int, default: int | None = None) -> int:
            value = raw.get(key, default)
            if value is None:
                raise GlmkitError(f"{source}: missing config key {key!r}")
            if isinstance(value, bool) or not isinstance(value, int):
                raise GlmkitError(f"{source}: {key!r} must be an integer, got {value!r}")
            if not lo <= value <= hi:
                raise GlmkitError(f"{source}: {key!r}={value} is outside the supported range [{lo}, {hi}]")
            return value

        def get_float(key: str, default: float | None = None) -> float:
            value = raw.get(key, default)
            if value is None:
                raise GlmkitError(f"{source}: missing config key {key!r}")
            if (isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
                    or not math.isfinite(value)):
                raise GlmkitError(f"{source}: {key!r} must be a positive finite number, got {value!r}")
            return float(value)

        layers = get_int("num_hidden_layers", 1, _MAX_LAYERS)
        n_experts = get_int("n_routed_experts", 1, _MAX_EXPERTS)
        n_group = get_int("n_group", 1, n_experts, default=1)
        if n_experts % n_group:
            raise GlmkitError(f"{source}: n_routed_experts={n_experts} is not divisible by n_group={n_group}")
        rope_dim = get_int("qk_rope_head_dim", 2, _MAX_DIM)
        if rope_dim % 2:
            raise GlmkitError(f"{source}: qk_rope_head_dim={rope_dim} must be even")
        index_head_dim = get_int("index_head_dim", rope_dim, _MAX_DIM)

        rope_params = raw.get("rope_parameters") or {}
        if not isinstance(rope_params, dict):
            raise GlmkitError(f"{source}: 'rope_parameters' must be an object")
        rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
        if rope_type not in ("default", None):
            raise GlmkitError(f"{source}: rope_type {rope_type!r} is not supported (only 'default')")
        rope_theta = rope_params.get("rope_theta", raw.get("rope_theta", 10000.0))
        if (isinstance(rope_theta, bool) or not isinstance(rope_theta, int | float) or not rope_theta > 0
                or not math.isfinite(rope_theta)):
            raise GlmkitError(f"{source}: rope_theta must be a positive finite number, got {rope_theta!r}")
        norm_topk_prob = raw.get("norm_topk_prob", True)
        if not isinstance(norm_topk_prob, bool):
            raise GlmkitError(f"{source}: 'norm_topk_prob' must be true or false, got {norm_topk_prob!r}")

        vocab_size = get_int("vocab_size", 1, _MAX_VOCAB)
        eos = raw.get("eos_token_id", [])
        eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ()
        if len(eos_ids) > _MAX_EOS_IDS or not all(isinstance(i, int) and not isinstance(i, bool)
                                                   and 0 <= i < vocab_size for i in eos_ids):
            raise GlmkitError(f"{source}: eos_token_id must be a token id below vocab_size={vocab_size} or a list "
                              f"of at most {_MAX_EOS_IDS} of them")
        nextn = get_int("num_nextn_predict_layers", 0, 1, default=0)
        if (layers + nextn) * n_experts > _MAX_EXPERT_LAYERS:
            raise GlmkitError(f"{source}: {layers + nextn} layers of {n_experts} routed experts exceed the supported "
                              f"{_MAX_EXPERT_LAYERS} expert matrices")

        cfg = cls(
            vocab_size=vocab_size,
            hidden_size=get_int("hidden_size", 1, _MAX_DIM),
            num_hidden_layers=layers,
            num_attention_heads=get_int("num_attention_heads", 1, 1024),
            q_lora_rank=get_int("q_lora_rank", 1, _MAX_DIM),
            kv_lora_rank=get_int("kv_lora_rank", 1, _MAX_DIM),
            qk_nope_head_dim=get_int("qk_nope_head_dim", 1, _MAX_DIM),
            qk_rope_head_dim=rope_dim,
            v_head_dim=get_int("v_head_dim", 1, _MAX_DIM),
            intermediate_size=get_int("intermediate_size", 1, _MAX_DIM),
            moe_intermediate_size=get_int("moe_intermediate_size", 1, _MAX_DIM),
            n_routed_experts=n_experts,
            num_experts_per_tok=get_int("num_experts_per_tok", 1, n_experts),
            n_shared_experts=get_int("n_shared_experts", 0, 64, default=1),
            n_group=n_group,
            topk_group=get_int("topk_group", 1, n_group, default=1),
            first_k_dense_replace=get_int("first_k_dense_replace", 0, layers, default=0),
            routed_scaling_factor=get_float("routed_scaling_factor", 1.0),
            norm_topk_prob=norm_topk_prob,
            rms_norm_eps=get_float("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            index_topk=get_int("index_topk", 1, _MAX_POSITIONS),
            index_n_heads=get_int("index_n_heads", 1, 1024),
            index_head_dim=index_head_dim,
            indexer_types=_indexer_types(raw, layers, source),
            num_nextn_predict_layers=nextn,
            max_position_embeddings=get_int("max_position_embeddings", 1, _MAX_POSITIONS, default=4096),
            eos_token_ids=eos_ids,
        )
        if cfg.num_experts_per_tok > (n_experts // n_group) * cfg.topk_group:
            raise GlmkitError(f"{source}: num_experts_per_tok exceeds the experts in topk_group groups")
        return cfg


def _indexer_types(raw: dict[str, Any], layers: int, source: str) -> tuple[str, ...]:
    """Per-layer DSA indexer type: explicit pattern/list if given, else the freq/offset rule (DESIGN 3)."""
    # Same precedence as transformers 5.23: indexer_types, then index_topk_pattern, then freq/offset.
    types = raw.get("indexer_types")
    pattern = raw.get("index_topk_pattern")
    if types is not None:
        if (not isinstance(types, list) or len(types) != layers
                or not all(isinstance(t, str) and t in ("full", "shared") for t in types)):
            raise GlmkitError(f"{source}: indexer_types must list 'full'/'shared' for all {layers} layers")
        types = tuple(types)
    elif pattern is not None:
        if not isinstance(pattern, str) or len(pattern) != layers or set(pattern) - {"F", "S"}:
            raise GlmkitError(f"{source}: index_topk_pattern must be {layers} characters of F/S")
        types = tuple("full" if c == "F" else "shared" for c in pattern)
    else:
        freq = raw.get("index_topk_freq", 1)
        offset = raw.get("index_skip_topk_offset", 2)
        if any(isinstance(v, bool) or not isinstance(v, int) or abs(v) > _MAX_LAYERS for v in (freq, offset)):
            raise GlmkitError(f"{source}: index_topk_freq/index_skip_topk_offset must be integers of at most "
                              f"{_MAX_LAYERS}")
        freq = max(freq, 1)
        types = tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers))
    if types[0] != "full":
        raise GlmkitError(f"{source}: layer 0 must be a 'full' indexer layer (a shared layer needs one before it)")
    return types
