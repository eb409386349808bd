"""Opening containers: zero-copy views, and every way a container can be broken."""

import json

import numpy as np
import pytest

from glmkit.cli.convert import main as convert_main
from glmkit.errors import GlmkitError
from glmkit.format.reader import Container
from tools.synth import make_snapshot


@pytest.fixture()
def container_dir(tmp_path):
    make_snapshot(tmp_path / "src")
    assert convert_main([str(tmp_path / "src"), str(tmp_path / "c"), "--quiet"]) == 0
    return tmp_path / "c"


def test_weights_are_views_into_the_mapping(container_dir):
    c = Container(container_dir)
    norm = c.weight("model.norm.weight")
    assert isinstance(norm, np.ndarray) and not norm.flags.owndata and not norm.flags.writeable
    w = c.weight("model.layers.1.mlp.experts.0.gate_proj.weight")
    assert not w.packed.flags.owndata and not w.scales.flags.owndata
    c.advise_experts(1, [0, 1, 3])
    # made once: decode asks for every weight each token, and backends key their device views by identity
    assert c.weight("model.layers.1.mlp.experts.0.gate_proj.weight") is w and c.weight("model.norm.weight") is norm
    c.close()
    assert c._weights == {}  # closing drops the views, so the mappings can go


def test_missing_and_not_a_container(tmp_path):
    with pytest.raises(GlmkitError, match="not found"):
        Container(tmp_path / "nope")
    with pytest.raises(GlmkitError, match="not a glmkit container"):
        Container(tmp_path)


def _edit_manifest(directory, edit):
    path = directory / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def test_newer_format_version_is_refused(container_dir):
    _edit_manifest(container_dir, lambda m: m.update(format_version=2))
    with pytest.raises(GlmkitError, match="format version 2 is newer"):
        Container(container_dir)


def test_hand_edited_manifest_fails_the_hash(container_dir):
    _edit_manifest(container_dir, lambda m: m["tensors"]["model.norm.weight"].update(offset=0))
    with pytest.raises(GlmkitError, match="does not match its model hash"):
        Container(container_dir)


def test_truncated_data_file(container_dir):
    data = next(container_dir.glob("model-*.safetensors"))
    data.write_bytes(data.read_bytes()[:-1])
    with pytest.raises(GlmkitError, match=f"{data.name}.*truncated"):
        Container(container_dir)


def test_edited_config_is_detected(container_dir):
    cfg = json.loads((container_dir / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-3
    (container_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(GlmkitError, match="config.json: does not match the manifest"):
        Container(container_dir)


def test_corrupted_bytes_found_by_verify(container_dir):
    c = Container(container_dir)
    e = c.manifest.tensors["lm_head.weight"]
    c.close()
    data = container_dir / e.file
    raw = bytearray(data.read_bytes())
    raw[e.offset] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert Container(container_dir).verify_data() == ["lm_head.weight"]
