"""Every bad input: one clear line naming the culprit, a nonzero exit, no valid-looking manifest in OUT."""

import json
import struct

import pytest

from glmkit.cli.convert import main as convert_main
from glmkit.errors import GlmkitError
from glmkit.format.reader import Container
from tools.synth import TINY_CONFIG, make_snapshot, make_weights


def run_bad(capsys, src, out, *args) -> str:
    assert convert_main([str(src), str(out), "--quiet", *args]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("glm-convert: error: "), err
    assert not (out / "manifest.json").exists()
    assert not list(out.glob("*.tmp")) if out.exists() else True
    return err


def snapshot_with_config(tmp_path, **changes):
    src = tmp_path / "src"
    make_snapshot(src)
    cfg = {**TINY_CONFIG, **changes}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (src / "config.json").write_text(json.dumps(cfg))
    return src


@pytest.mark.parametrize("changes,expected", [
    ({"model_type": None}, "missing 'model_type'"),
    ({"model_type": "llama"}, "unsupported model_type 'llama'"),
    ({"hidden_size": None}, "missing config key 'hidden_size'"),
    ({"n_routed_experts": 10**9}, "'n_routed_experts'=1000000000 is outside"),
    ({"vocab_size": 2**40}, "'vocab_size'"),
    ({"num_attention_heads": "4"}, "'num_attention_heads' must be an integer"),
    ({"n_group": 3}, "not divisible by n_group"),
    ({"indexer_types": ["full", "shared"]}, "indexer_types"),
])
def test_bad_config(tmp_path, capsys, changes, expected):
    err = run_bad(capsys, snapshot_with_config(tmp_path, **changes), tmp_path / "out")
    assert expected in err and "config.json" in err


def test_shape_inconsistent_with_config(tmp_path, capsys):
    src = snapshot_with_config(tmp_path, moe_intermediate_size=20)
    err = run_bad(capsys, src, tmp_path / "out")
    assert "model.safetensors" in err and "shared_experts" in err and "config.json implies" in err


def test_truncated_safetensors(tmp_path, capsys):
    src = tmp_path / "src"
    make_snapshot(src, shards=2)
    shard = src / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    err = run_bad(capsys, src, tmp_path / "out")
    assert "model-00002-of-00002.safetensors" in err and "past the end of the file" in err


def test_truncated_to_nothing(tmp_path, capsys):
    src = tmp_path / "src"
    make_snapshot(src)
    (src / "model.safetensors").write_bytes(b"\x10\x00")
    assert "truncated safetensors file" in run_bad(capsys, src, tmp_path / "out")


def _rewrite_header(path, edit):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])


def test_header_lying_about_offsets(tmp_path, capsys):
    src = tmp_path / "src"
    make_snapshot(src)
    name = "model.layers.0.self_attn.o_proj.weight"

    def lie(header):
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [begin + 2, end + 2]
    _rewrite_header(src / "model.safetensors", lie)
    err = run_bad(capsys, src, tmp_path / "out")
    assert name in err and "model.safetensors" in err


def test_header_length_larger_than_file(tmp_path, capsys):
    src = tmp_path / "src"
    make_snapshot(src)
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + data[8:])
    assert "header length" in run_bad(capsys, src, tmp_path / "out")


def test_missing_expert_tensor(tmp_path, capsys):
    src = tmp_path / "src"
    name = "model.layers.2.mlp.experts.3.down_proj.weight"
    make_snapshot(src, weights={n: w for n, w in make_weights(TINY_CONFIG).items() if n != name})
    err = run_bad(capsys, src, tmp_path / "out")
    assert name in err and "missing" in err


def test_existing_non_empty_out_needs_force(tmp_path, capsys):
    src = tmp_path / "src"
    make_snapshot(src)
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    err = run_bad(capsys, src, out)
    assert str(out) in err and "--force" in err
    assert (out / "precious.txt").read_text() == "keep me"
    assert convert_main([str(src), str(out), "--quiet", "--force"]) == 0
    assert (out / "manifest.json").is_file()


def test_force_with_a_bad_source_leaves_the_old_container_untouched(tmp_path, capsys):
    src = tmp_path / "src"
    make_snapshot(src)
    out = tmp_path / "out"
    assert convert_main([str(src), str(out), "--quiet"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (src / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[:-10])
    assert convert_main([str(src), str(out), "--quiet", "--force"]) == 1
    assert "past the end" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # checks run before OUT is touched
    Container(out)


def test_failure_mid_conversion_leaves_no_manifest(tmp_path, capsys, monkeypatch):
    src = tmp_path / "src"
    make_snapshot(src)
    out = tmp_path / "out"
    assert convert_main([str(src), str(out), "--quiet"]) == 0
    from glmkit.convert.sources import snapshot

    def broken(self, spec):
        if "layers.2" in spec.name:
            raise GlmkitError(f"{spec.name}: simulated read failure")
        return real(self, spec)
    real = snapshot.HFSnapshot.load
    monkeypatch.setattr(snapshot.HFSnapshot, "load", broken)
    assert "simulated read failure" in run_bad(capsys, src, out, "--force")


def test_missing_source_and_bad_flags(tmp_path, capsys):
    assert "not found" in run_bad(capsys, tmp_path / "nope", tmp_path / "out")
    src = tmp_path / "src"
    make_snapshot(src)
    assert "--group-size" in run_bad(capsys, src, tmp_path / "out", "--group-size", "-1")


@pytest.mark.parametrize("group", ["4096", "99999999999999999999"])
def test_a_group_wider_than_every_row_is_refused_before_writing(tmp_path, capsys, group):
    """Each row is padded to whole groups: such a group would make the work (or an array) as large as the number.
    Refused before OUT is touched, by a dry run too."""
    src = tmp_path / "src"
    make_snapshot(src)
    for dry in ((), ("--dry-run",)):
        err = run_bad(capsys, src, tmp_path / "out", "--group-size", group, *dry)
        assert err.startswith(f"glm-convert: error: --group-size: {group} is wider than every weight's rows")
        assert not (tmp_path / "out").exists()
