"""The layer description (glmkit.model.layer_spec) that the model and the device decode step both read: every tensor
it names is one the container schema lists, its choices follow the config, and the decode step refuses a layer its
kernels do not compute rather than binding part of it."""

from __future__ import annotations

import dataclasses

import pytest

from glmkit.backends.opencl.decode_graph import Unsupported, check_bindable
from glmkit.format.config import ModelConfig
from glmkit.format.schema import model_tensors
from glmkit.model.layer_spec import (
    EMBED,
    LM_HEAD,
    LayerSpec,
    MLPSpec,
    MoESpec,
    NormSpec,
    final_norm_spec,
    layer_spec,
    mtp_spec,
)
from tests.runtime_support import FIXTURES


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_file(FIXTURES / "tiny-trained" / "config.json")


def names_of(spec: LayerSpec) -> set[str]:
    """Every tensor name a layer's description holds (all its experts included)."""
    out: set[str] = set()

    def walk(value: object) -> None:
        if isinstance(value, str) and value.startswith(("model.", "lm_head.")):
            out.add(value)
        elif dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name))

    walk(spec)
    if isinstance(spec.ffn, MoESpec):
        for e in range(spec.ffn.router.n_experts):
            walk(spec.ffn.expert(e))
    return out


def test_every_named_tensor_is_in_the_schema(cfg):
    schema = {t.name for t in model_tensors(cfg)}
    described = {EMBED, LM_HEAD, final_norm_spec(cfg).weight}
    mtp = mtp_spec(cfg)
    described |= {mtp.eh_proj, mtp.enorm.weight, mtp.hnorm.weight, mtp.head_norm.weight}
    for layer in range(cfg.num_layers_with_mtp):
        spec = layer_spec(cfg, layer, schema.__contains__)
        assert set(spec.vectors()) <= names_of(spec)
        described |= names_of(spec)
    assert described == schema  # nothing the container holds goes unread, nothing read is missing from it


def test_stages_follow_the_config(cfg):
    has_all = lambda name: True  # noqa: E731
    specs = [layer_spec(cfg, i, has_all) for i in range(cfg.num_hidden_layers)]
    for spec in specs:
        full = cfg.indexer_type(spec.index) == "full"
        assert spec.attention.selection == ("indexer" if full else "previous")
        assert (spec.attention.indexer is not None) == full
        assert isinstance(spec.ffn, MoESpec) == cfg.is_moe_layer(spec.index)
    indexer = next(s.attention.indexer for s in specs if s.attention.indexer is not None)
    assert indexer.topk == cfg.index_topk and indexer.key_norm.bias is not None
    assert specs[0].attention.scale == cfg.qk_head_dim ** -0.5
    # an MTP layer shipped without indexer weights attends to every causal key
    mtp = layer_spec(cfg, cfg.num_hidden_layers, lambda name: "indexer" not in name)
    assert mtp.attention.selection == "causal" and mtp.attention.indexer is None


def test_the_decode_step_refuses_what_its_kernels_do_not_compute(cfg):
    specs = [layer_spec(cfg, i, lambda name: True) for i in range(cfg.num_hidden_layers)]
    check_bindable(specs)  # the fixture's own layers bind

    def changed(index: int, **attention) -> list[LayerSpec]:
        out = list(specs)
        out[index] = dataclasses.replace(specs[index], attention=dataclasses.replace(specs[index].attention,
                                                                                     **attention))
        return out

    first = specs[0].attention
    last = max(s.index for s in specs if s.attention.indexer is not None)
    assert first.indexer is not None and last > 0  # the fixture has two layers with an indexer
    cases = {
        "latent norms": changed(0, kv_a_norm=NormSpec(first.kv_a_norm.weight, 1e-5)),
        "RoPE": changed(1, rope_theta=first.rope_theta * 2),
        "selection": changed(0, selection="previous", indexer=None),
        "causal": changed(1, selection="causal", indexer=None),
        "keys": changed(last, indexer=dataclasses.replace(specs[last].attention.indexer, topk=first.indexer.topk + 1)),
        "LayerNorm": [dataclasses.replace(specs[0], input_norm=NormSpec("x.weight", 1e-5, "x.bias")), *specs[1:]],
    }
    for what, layers in cases.items():
        with pytest.raises(Unsupported):
            check_bindable(layers)
            pytest.fail(f"bound a layer with other {what}")


def test_mlp_spec_names_the_three_projections():
    mlp = MLPSpec.at("model.layers.3.mlp.shared_experts.")
    assert mlp.names == tuple(f"model.layers.3.mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down"))
