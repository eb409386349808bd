"""tools/synth.py's streaming snapshots: `residual_write_scale` scales exactly the weights that add into the residual
stream, leaves every other tensor as it was, and is recorded in synth.json (only where it is not 1.0)."""

from __future__ import annotations

import json

import numpy as np

from glmkit.convert.sources.snapshot import HFSnapshot
from glmkit.format.config import ModelConfig
from glmkit.format.schema import model_tensors
from tests.runtime_support import FIXTURES
from tools.synth import RESIDUAL_WRITERS, write_snapshot_streaming


def test_residual_write_scale_scales_only_the_residual_writers(tmp_path):
    config = json.loads((FIXTURES / "tiny-trained" / "config.json").read_text())
    write_snapshot_streaming(tmp_path / "plain", config, shards=2)
    write_snapshot_streaming(tmp_path / "scaled", config, shards=2, residual_write_scale=0.125)
    assert json.loads((tmp_path / "plain" / "synth.json").read_text()) == {"seed": 0, "router_bias_std": 1.0}
    assert json.loads((tmp_path / "scaled" / "synth.json").read_text())["residual_write_scale"] == 0.125
    plain, scaled = HFSnapshot(tmp_path / "plain"), HFSnapshot(tmp_path / "scaled")
    writers = 0
    for spec in model_tensors(ModelConfig.from_dict(config)):
        a, b = plain.load(spec), scaled.load(spec)
        if spec.name.endswith(RESIDUAL_WRITERS):
            writers += 1
            # a power of two: the scaled draw rounds to bf16 exactly as the plain one, times 0.125
            assert np.array_equal(b, a * np.float32(0.125)), spec.name
        else:
            assert np.array_equal(a, b), spec.name
    cfg = ModelConfig.from_dict(config)
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers_with_mtp))
    dense = cfg.num_layers_with_mtp - moe
    # every layer's o_proj; each dense MLP's down_proj; each MoE layer's routed experts' and shared expert's
    assert writers == cfg.num_layers_with_mtp + dense + moe * (cfg.n_routed_experts + 1)
