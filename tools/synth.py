"""Synthetic HF snapshots for converter tests (no torch): random weights written as real safetensors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from glmkit.format.config import ModelConfig
from glmkit.format.schema import model_tensors

ST_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
             np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}

TINY_CONFIG = {
    "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"], "vocab_size": 96, "hidden_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4, "v_head_dim": 8, "head_dim": 12, "intermediate_size": 136, "moe_intermediate_size": 24,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
    "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"}, "index_topk": 4, "index_n_heads": 2,
    "index_head_dim": 8, "indexer_types": ["full", "shared", "full"], "num_nextn_predict_layers": 1,
    "max_position_embeddings": 256, "eos_token_id": [1, 2],
}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, pos = {}, 0
    for name, a in tensors.items():
        header[name] = {"dtype": ST_DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [pos, pos + a.nbytes]}
        pos += a.nbytes
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())


def fp8_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [O, I] -> (F8_E4M3 weight, weight_scale_inv [ceil(O/128), ceil(I/128)]) with 128x128 blocks."""
    rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
    scale = np.ones((rows, cols), np.float32)
    q = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
    for r in range(rows):
        for c in range(cols):
            block = w[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128]
            scale[r, c] = max(float(np.abs(block).max()) / 448.0, 1e-12)
            q[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128] = (block / scale[r, c]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def make_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights for every tensor the config implies (HF names, per-expert)."""
    rng = np.random.default_rng(seed)
    cfg = ModelConfig.from_dict(config)
    out = {}
    for spec in model_tensors(cfg):
        scale = 1.0 if len(spec.shape) == 1 else spec.shape[-1] ** -0.5
        out[spec.name] = (rng.standard_normal(spec.shape) * scale).astype(np.float32)
    return out


def make_snapshot(directory: Path, config: dict | None = None, *, dtype: str = "BF16", shards: int = 1,
                  fused: bool = False, fp8: bool = False, seed: int = 0, with_index: bool = True,
                  weights: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Write an HF-layout snapshot; returns the float32 weights it encodes (after BF16/FP8 rounding)."""
    config = dict(config or TINY_CONFIG)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": config.get("eos_token_id")}))
    weights = weights if weights is not None else make_weights(config, seed)
    stored: dict[str, np.ndarray] = {}
    exact: dict[str, np.ndarray] = {}
    np_dtype = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}[dtype]
    for name, w in weights.items():
        if name.endswith("e_score_correction_bias"):
            stored[name] = w  # F32 in every release
        elif fp8 and w.ndim == 2 and "embed" not in name and "lm_head" not in name and ".gate.weight" not in name:
            q, s = fp8_quantize(w)
            stored[name] = q
            stored[name.removesuffix(".weight") + ".weight_scale_inv"] = s
            full = np.repeat(np.repeat(s, 128, 0), 128, 1)[:w.shape[0], :w.shape[1]]
            exact[name] = q.astype(np.float32) * full
            continue
        stored[name] = w.astype(np_dtype)
        exact[name] = stored[name].astype(np.float32)
    if fused:
        stored = _fuse_experts(stored)
    names = list(stored)
    per_shard = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        fname = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        chunk = names[i * per_shard:(i + 1) * per_shard]
        write_safetensors(directory / fname, {n: stored[n] for n in chunk})
        weight_map.update(dict.fromkeys(chunk, fname))
    if with_index and shards > 1:
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return exact


def _fuse_experts(stored: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Replace per-expert tensors by `mlp.experts.gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    for name, a in stored.items():
        head, sep, tail = name.partition("mlp.experts.")
        if not sep:
            out[name] = a
            continue
        e, proj, _ = tail.split(".")
        experts.setdefault(head, {}).setdefault(int(e), {})[proj] = a
    for head, per in experts.items():
        order = sorted(per)
        out[head + "mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([per[e]["gate_proj"], per[e]["up_proj"]]) for e in order])
        out[head + "mlp.experts.down_proj"] = np.stack([per[e]["down_proj"] for e in order])
    return out


RESIDUAL_WRITERS = ("self_attn.o_proj.weight", "down_proj.weight")  # the products that add into the residual stream


def write_snapshot_streaming(directory: Path, config: dict, *, shards: int = 8, fp8: bool = False,
                             seed: int = 0, router_bias_std: float = 1.0, residual_write_scale: float = 1.0) -> int:
    """Write a large random HF snapshot one tensor at a time (memory: one tensor); returns the bytes written.

    Same layout rules as `make_snapshot` (BF16, or FP8 with 128x128 `weight_scale_inv` for 2-D weights other
    than embeddings, lm_head and the router; `e_score_correction_bias` F32; per-expert names), but the
    weights are not returned and tensors are balanced over `shards` files by size. Tensor `i` is drawn from
    `default_rng([seed, i])`, so the content does not depend on the shard count. router_bias_std: the spread of
    `e_score_correction_bias` (at 1.0 it outweighs the router's sigmoid scores, so every token picks nearly the
    same experts; a small spread routes each token to its own experts, as a trained, load-balanced router does).
    residual_write_scale: a factor on the weights that add into the residual stream (attention's output
    projection, every MLP's and expert's down projection). At 1.0 each layer's output outweighs the stream it adds
    to, so one layer's hidden state says little of the next's routing; a small factor makes each layer a small
    change of the stream, as in a trained model, where one layer's router input predicts the next's.
    The parameters are recorded in `synth.json` (`residual_write_scale` only where it is not 1.0).
    """
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "synth.json").write_text(json.dumps(synth_params(seed, router_bias_std, residual_write_scale)))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": config.get("eos_token_id")}))
    specs = model_tensors(ModelConfig.from_dict(config))

    def is_fp8(name: str, shape: tuple[int, ...]) -> bool:
        return (fp8 and len(shape) == 2 and "embed" not in name and "lm_head" not in name
                and ".gate.weight" not in name)

    # (spec index, stored name, dtype, shape) in write order; an FP8 weight's scales follow it
    stored: list[tuple[int, str, str, tuple[int, ...]]] = []
    for i, spec in enumerate(specs):
        if spec.name.endswith("e_score_correction_bias"):
            stored.append((i, spec.name, "F32", spec.shape))
        elif is_fp8(spec.name, spec.shape):
            rows, cols = -(-spec.shape[0] // 128), -(-spec.shape[1] // 128)
            stored.append((i, spec.name, "F8_E4M3", spec.shape))
            stored.append((i, spec.name.removesuffix(".weight") + ".weight_scale_inv", "F32", (rows, cols)))
        else:
            stored.append((i, spec.name, "BF16", spec.shape))
    itemsize = {"F32": 4, "BF16": 2, "F8_E4M3": 1}
    nbytes = [int(np.prod(s)) * itemsize[d] for _, _, d, s in stored]
    target = sum(nbytes) / shards
    groups: list[list[int]] = [[]]
    acc = 0
    for k, n in enumerate(nbytes):
        # never separate an FP8 weight from its scales (they are generated together)
        follows_weight = k > 0 and stored[k - 1][0] == stored[k][0]
        if groups[-1] and acc >= target * len(groups) and len(groups) < shards and not follows_weight:
            groups.append([])
        groups[-1].append(k)
        acc += n
    weight_map: dict[str, str] = {}
    total = 0
    for g, members in enumerate(groups):
        fname = f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors"
        header, pos = {}, 0
        for k in members:
            _, name, dtype, shape = stored[k]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes[k]]}
            pos += nbytes[k]
            weight_map[name] = fname
        text = json.dumps(header).encode()
        with open(directory / fname, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            pending_scale = None
            for k in members:
                i, name, dtype, shape = stored[k]
                if name.endswith(".weight_scale_inv"):
                    assert pending_scale is not None
                    f.write(pending_scale.tobytes())
                    pending_scale = None
                    continue
                rng = np.random.default_rng([seed, i])
                scale = 1.0 if len(shape) == 1 else shape[-1] ** -0.5
                if name.endswith("e_score_correction_bias"):
                    scale = router_bias_std
                elif name.endswith(RESIDUAL_WRITERS):
                    scale *= residual_write_scale
                w = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
                if dtype == "F8_E4M3":
                    q, pending_scale = _fp8_quantize_blocks(w)
                    f.write(q.tobytes())
                elif dtype == "F32":
                    f.write(w.tobytes())
                else:
                    f.write(w.astype(ml_dtypes.bfloat16).tobytes())
        total += 8 + len(text) + pos
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": sum(nbytes)}, "weight_map": weight_map}))
    return total


def synth_params(seed: int = 0, router_bias_std: float = 1.0, residual_write_scale: float = 1.0) -> dict:
    """What `synth.json` records of a streaming snapshot's parameters."""
    params = {"seed": seed, "router_bias_std": router_bias_std}
    return params if residual_write_scale == 1.0 else {**params, "residual_write_scale": residual_write_scale}


def _fp8_quantize_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized `fp8_quantize`: same 128x128 blocks and scales, without a Python loop over blocks."""
    rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
    padded = np.zeros((rows * 128, cols * 128), np.float32)
    padded[:w.shape[0], :w.shape[1]] = np.abs(w)
    amax = padded.reshape(rows, 128, cols, 128).max(axis=(1, 3))
    scale = np.maximum(amax / np.float32(448.0), np.float32(1e-12)).astype(np.float32)
    full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:w.shape[0], :w.shape[1]]
    return (w / full).astype(ml_dtypes.float8_e4m3fn), scale
