"""Check glmkit's NumPy forward pass against transformers 5.23.0 on a tiny random `glm_moe_dsa` model.

Oracle extra: needs torch + transformers (`pip install .[oracle]`); the glmkit package never imports them.
Modes, each compared with transformers' teacher-forcing logits over the whole sequence:
  prefill   all tokens in one call (full MLA reconstruction, DSA top-k over 30 keys with index_topk 8)
  decode    a prefix, then one token per call (kv_b absorbed)
  chunked7  chunks of 7 on a non-empty cache (reconstruction); chunked3: chunks of 3 (absorbed, multi-row)
  mtp       the MTP layer vs a transformers decoder layer wired per DESIGN section 3 (prefill and decode)
and quantized weights: the decode kernels (fused, blockwise) vs the prefill kernels on the same model.

Usage: python tools/check_model_vs_transformers.py [--seed N] [--tokens N]
Exit status 1 if any mode differs by more than --tol relative to the logit scale.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer, GlmMoeDsaRMSNorm

from glmkit.backends.numpy_backend import NumpyBackend
from glmkit.format.config import ModelConfig
from glmkit.format.packing import pack, quantize
from glmkit.format.tensors import QuantWeight, Weight
from glmkit.model.glm5 import GlmMoeDsaModel

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
    n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    index_topk=8, index_n_heads=4, index_head_dim=16, indexer_types=["full", "shared", "full", "shared"],
    rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    max_position_embeddings=512, tie_word_embeddings=False,
)


class DictWeights:
    """Weight source over a dict of f32 arrays / QuantWeights keyed by Hugging Face names."""

    def __init__(self, tensors: dict[str, Weight]) -> None:
        self.tensors = tensors

    def weight(self, name: str) -> Weight:
        return self.tensors[name]

    def has(self, name: str) -> bool:
        return name in self.tensors


def randomize(module: torch.nn.Module, gen: torch.Generator, index_heads: int) -> None:
    """Give every parameter O(1)-activation random values, and make index heads pairwise negated.

    Default init (std 0.02) gives logits ~0 where any error hides; norm weights near 1 and
    1/sqrt(fan_in) matrices keep activations O(1). Negated indexer head pairs mean exactly one of the
    pair is positive after the ReLU, so index scores cannot tie at 0.
    """
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / fan_in ** 0.5))
        for name, buf in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))
        for name, p in module.named_parameters():
            if name.endswith("indexer.wq_b.weight"):
                heads = p.view(index_heads, -1, p.shape[-1])
                heads[1::2] = -heads[0::2]


def to_numpy_weights(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, Weight]:
    """state_dict -> read-only f32 arrays under `prefix + name`, fused experts split per expert."""
    out: dict[str, Weight] = {}
    for name, tensor in state.items():
        name = prefix + name
        array = tensor.detach().float().numpy().copy()
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H], gate rows first
            base = name[: -len("gate_up_proj")]
            half = array.shape[1] // 2
            for e, fused in enumerate(array):
                out[f"{base}{e}.gate_proj.weight"] = fused[:half]
                out[f"{base}{e}.up_proj.weight"] = fused[half:]
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            base = name[: -len("down_proj")]
            for e, down in enumerate(array):
                out[f"{base}{e}.down_proj.weight"] = down
        else:
            out[name] = array
    for array in out.values():
        array.setflags(write=False)
    return out


def relative_diff(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def run_prefill(model: GlmMoeDsaModel, ids: np.ndarray) -> np.ndarray:
    return model.forward(ids, model.new_cache())[0]


def run_chunks(model: GlmMoeDsaModel, ids: np.ndarray, first: int, chunk: int) -> np.ndarray:
    """Prefill `first` tokens, then feed the rest `chunk` tokens per call; logits of every position."""
    cache = model.new_cache()
    parts = [model.forward(ids[:first], cache)[0]]
    for start in range(first, len(ids), chunk):
        parts.append(model.forward(ids[start: start + chunk], cache)[0])
    return np.concatenate(parts)


def build_mtp(hf_config: GlmMoeDsaConfig, gen: torch.Generator) -> dict[str, torch.nn.Module]:
    """The MTP layer's modules: a transformers decoder layer at index num_hidden_layers + its extras."""
    raw = hf_config.to_dict()
    n = hf_config.num_hidden_layers
    raw.update(num_hidden_layers=n + 1, indexer_types=list(hf_config.indexer_types) + ["full"])
    config = GlmMoeDsaConfig(**{k: v for k, v in raw.items() if k not in ("mlp_layer_types", "layer_types")})
    config._attn_implementation = "eager"
    h = hf_config.hidden_size
    parts = {
        "layer": GlmMoeDsaDecoderLayer(config, n),
        "eh_proj": torch.nn.Linear(2 * h, h, bias=False),
        "enorm": GlmMoeDsaRMSNorm(h, hf_config.rms_norm_eps),
        "hnorm": GlmMoeDsaRMSNorm(h, hf_config.rms_norm_eps),
        "shared_head.norm": GlmMoeDsaRMSNorm(h, hf_config.rms_norm_eps),
    }
    for module in parts.values():
        randomize(module, gen, hf_config.index_n_heads)
    return parts


def mtp_reference(hf: GlmMoeDsaForCausalLM, mtp: dict[str, torch.nn.Module], ids: torch.Tensor) -> np.ndarray:
    """DESIGN's MTP with transformers modules: logits of the draft for every position but the last."""
    with torch.no_grad():
        hidden = hf.model(ids[None]).last_hidden_state[0]  # post-final-norm
        emb = hf.model.embed_tokens(ids[1:])
        x = mtp["eh_proj"](torch.cat([mtp["enorm"](emb), mtp["hnorm"](hidden[:-1])], dim=-1))[None]
        seq = x.shape[1]
        positions = torch.arange(seq)[None]
        mask = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1)[None, None]
        out, _ = mtp["layer"](x, attention_mask=mask, position_ids=positions,
                              position_embeddings=hf.model.rotary_emb(x, positions))
        return hf.lm_head(mtp["shared_head.norm"](out))[0].numpy()


def quantize_some(tensors: dict[str, Weight]) -> dict[str, Weight]:
    """A mix of schemes: int8 per-row, int4 grouped (partial last group), int2 grouped and per-row."""
    schemes = {"embed_tokens": (8, None), "lm_head": (8, None), "q_b_proj": (4, 24), "kv_b_proj": (4, 16),
               "o_proj": (2, 16), "experts.": (4, 24), "shared_experts": (8, None), "indexer.wq_b": (2, None)}
    out = dict(tensors)
    for name, w in tensors.items():
        for key, (bits, group) in schemes.items():
            if key in name and w.ndim == 2:
                codes, scales = quantize(w, bits, group)
                out[name] = QuantWeight(pack(codes, bits), scales, bits, group, w.shape)
                break
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=30)
    parser.add_argument("--tol", type=float, default=1e-5)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    hf_config = GlmMoeDsaConfig(**TINY)
    hf_config._attn_implementation = "eager"
    hf = GlmMoeDsaForCausalLM(hf_config).eval()
    randomize(hf, gen, hf_config.index_n_heads)
    mtp = build_mtp(hf_config, gen)

    ids_t = torch.randint(0, hf_config.vocab_size, (args.tokens,), generator=gen)
    ids = ids_t.numpy()
    with torch.no_grad():
        ref = hf(ids_t[None], use_cache=False).logits[0].numpy()
    mtp_ref = mtp_reference(hf, mtp, ids_t)

    n = hf_config.num_hidden_layers
    tensors = to_numpy_weights(hf.state_dict())
    tensors |= to_numpy_weights(mtp["layer"].state_dict(), f"model.layers.{n}.")
    for name in ("eh_proj", "enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.{n}.{name}.weight"] = mtp[name].weight.detach().numpy().copy()
    config = ModelConfig.from_dict({**hf_config.to_dict(), "num_nextn_predict_layers": 1})
    model = GlmMoeDsaModel(config, DictWeights(tensors), NumpyBackend())

    prefix = 10
    results = {
        "prefill": relative_diff(run_prefill(model, ids), ref),
        "decode": relative_diff(run_chunks(model, ids, prefix, 1), ref),
        "chunked7": relative_diff(run_chunks(model, ids, prefix, 7), ref),
        "chunked3": relative_diff(run_chunks(model, ids, prefix, 3), ref),
    }
    cache = model.new_cache()
    _, hidden = model.forward(ids, cache)
    results["mtp prefill"] = relative_diff(model.mtp_forward(hidden[:-1], ids[1:], cache)[0], mtp_ref)
    cache.layer(n).truncate(prefix)
    steps = [model.mtp_forward(hidden[i: i + 1], ids[i + 1: i + 2], cache)[0] for i in range(prefix, len(ids) - 1)]
    results["mtp decode"] = relative_diff(np.concatenate(steps), mtp_ref[prefix:])

    quant = GlmMoeDsaModel(config, DictWeights(quantize_some(tensors)), NumpyBackend())
    quant_prefill = run_prefill(quant, ids)
    results["quant decode vs prefill"] = relative_diff(run_chunks(quant, ids, prefix, 1), quant_prefill)
    results["quant chunked7 vs prefill"] = relative_diff(run_chunks(quant, ids, prefix, 7), quant_prefill)

    print(f"logit scale max|ref| = {np.abs(ref).max():.3f}; max|diff| / max|ref| per mode:")
    for mode, diff in results.items():
        print(f"  {mode:28s} {diff:.2e}  {'ok' if diff <= args.tol else 'FAIL'}")
    print(f"  greedy argmax agreement (prefill): {(run_prefill(model, ids).argmax(1) == ref.argmax(1)).mean():.3f}")

    for label, m in (("f32", model), ("quantized", quant)):
        run_prefill(m, ids)  # warm-up: first calls pay for imports and allocations
        cache = m.new_cache()
        t0 = time.perf_counter()
        m.forward(ids, cache)
        t1 = time.perf_counter()
        for token in ids[:32]:
            m.forward(np.array([token]), cache)
        t2 = time.perf_counter()
        print(f"speed {label}: prefill {len(ids) / (t1 - t0):.0f} tok/s, decode {32 / (t2 - t1):.0f} tok/s")
    return 0 if all(diff <= args.tol for diff in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
