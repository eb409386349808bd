"""The benchmark-size model: a random GLM-5-shaped checkpoint, converted once and reused.

About 0.45B parameters: vocab 8192, hidden 1024, 8 layers (2 dense), 8 heads, q_lora 384, kv_lora 128,
nope 64, rope 32, v 64, 32 experts top-8 + 1 shared, moe_intermediate 512, intermediate 2816, DSA top-k 256
with 8 heads of 64, an MTP layer. Random weights: speed and memory only, never quality.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from glmkit.cli.convert import main as convert_main
from glmkit.convert.plan import QuantPlan
from glmkit.format.config import ModelConfig
from glmkit.format.schema import model_tensors
from tools.synth import synth_params, write_snapshot_streaming

DEFAULT_WORK = Path("/tmp/glmkit-bench-model")

BENCH_CONFIG = {
    "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"], "vocab_size": 8192,
    "hidden_size": 1024, "num_hidden_layers": 8, "first_k_dense_replace": 2, "num_attention_heads": 8,
    "q_lora_rank": 384, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
    "intermediate_size": 2816, "moe_intermediate_size": 512, "n_routed_experts": 32, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "index_topk": 256, "index_n_heads": 8, "index_head_dim": 64, "index_topk_freq": 2,
    "index_skip_topk_offset": 2, "num_nextn_predict_layers": 1, "max_position_embeddings": 8192,
    "eos_token_id": [8190, 8191],
}


def ensure_bench_snapshot(preset: str = "q4", work: Path = DEFAULT_WORK, config: dict | None = None,
                          router_bias_std: float = 1.0, residual_write_scale: float = 1.0, grid: str = "nl") -> Path:
    """The converted benchmark model for `preset` (built on first use under `work`, and again when the preset's
    layout or the source's parameters have changed since); `config`: another shape than BENCH_CONFIG's;
    router_bias_std, residual_write_scale: see `write_snapshot_streaming`; grid: glm-convert's `--grid` (another
    than the default converts into a folder of its own, `q4-uniform`)."""
    source = work / "source"
    params = synth_params(0, router_bias_std, residual_write_scale)
    fresh = not (source / "config.json").is_file() or _synth_params(source) != params
    if fresh:
        write_snapshot_streaming(source, config or BENCH_CONFIG, shards=4, router_bias_std=router_bias_std,
                                 residual_write_scale=residual_write_scale)
    out = work / (preset if grid == "nl" else f"{preset}-{grid}")
    if fresh or not (out / "manifest.json").is_file() or not layout_is_current(out, preset):
        with contextlib.redirect_stdout(io.StringIO()):
            assert convert_main([str(source), str(out), "--preset", preset, "--grid", grid, "--quiet", "--force"]) == 0
    return out


def _synth_params(source: Path) -> dict:
    """The generation parameters a source was written with (`synth.json`; older sources: the defaults)."""
    path = source / "synth.json"
    return json.loads(path.read_text()) if path.is_file() else {"seed": 0, "router_bias_std": 1.0}


def layout_is_current(out: Path, preset: str) -> bool:
    """Whether every tensor of the container at `out` has the bits and scale group today's `preset` gives it."""
    tensors = json.loads((out / "manifest.json").read_text())["tensors"]
    plan = QuantPlan.from_preset(preset)
    for spec in model_tensors(ModelConfig.from_file(out / "config.json")):
        quant = tensors.get(spec.name, {}).get("quant")
        if (quant and (quant["bits"], quant["group_size"])) != (plan.quant_for(spec) or None):
            return False
    return True
