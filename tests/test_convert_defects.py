"""Hostile and mistaken conversion inputs: OUT overlapping SOURCE, a source changed between a kill and the
resume, non-finite or misread weights, a config that disagrees with the tensors, untrusted JSON side files,
and rerunning a finished conversion."""

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from glmkit.cli.convert import main as convert_main
from glmkit.convert.sources.snapshot import HFSnapshot
from glmkit.errors import GlmkitError
from glmkit.format.reader import Container
from glmkit.format.safetensors_file import read_header
from tests.runtime_support import FIXTURES
from tests.test_convert_errors import run_bad
from tools.synth import TINY_CONFIG, make_snapshot, make_weights


def tree_digest(directory) -> dict[str, str]:
    """sha256 of every regular file under `directory`, by relative path."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


# --- OUT must not be, hold or sit inside SOURCE ----------------------------------------------------------------

@pytest.mark.parametrize("where", ["same", "inside", "parent", "symlink"])
def test_out_overlapping_the_source_is_refused_before_touching_it(tmp_path, capsys, where):
    src = tmp_path / "model"
    make_snapshot(src, shards=2)  # Hub-style model-0000N-of-00002.safetensors, what OUT's cleanup deletes
    before = tree_digest(tmp_path)
    out = {"same": src, "inside": src / "q4", "parent": tmp_path}.get(where)
    if where == "symlink":
        out = tmp_path / "link"
        out.symlink_to(src)
        before = tree_digest(tmp_path)
    err = run_bad(capsys, src, out, "--preset", "q4", "--force")
    assert "source" in err and str(src) in err
    assert tree_digest(tmp_path) == before
    assert not (src / ".glm-convert").exists() and not (src / "q4").exists()


# --- a resumed conversion rechecks the local source ---------------------------------------------------------------

def _interrupted(tmp_path, monkeypatch, capsys):
    """A 2-shard snapshot whose conversion into OUT failed after some data files were complete."""
    src, out = tmp_path / "src", tmp_path / "out"
    make_snapshot(src, shards=2)
    real = HFSnapshot.load

    def broken(self, spec):
        if spec.name.startswith("model.layers.3."):
            raise GlmkitError(f"{spec.name}: simulated read failure")
        return real(self, spec)
    monkeypatch.setattr(HFSnapshot, "load", broken)
    args = [str(src), str(out), "--quiet", "--preset", "f32", "--max-file-size", "16K"]
    assert convert_main(args) == 1
    monkeypatch.setattr(HFSnapshot, "load", real)
    assert (out / ".glm-convert" / "done.jsonl").read_text().count("\n") >= 2
    capsys.readouterr()
    return src, out, args


def _edit_same_size(path, keep_mtime: bool) -> None:
    """Change one weight byte of the first tensor (same file size), optionally restoring the file's mtime."""
    stat = path.stat()
    info = read_header(path)["model.embed_tokens.weight"]
    data = bytearray(path.read_bytes())
    data[info.start + 1] ^= 0x40
    path.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_resume_refuses_a_source_shard_changed_since_the_first_run(tmp_path, monkeypatch, capsys, keep_mtime):
    src, out, args = _interrupted(tmp_path, monkeypatch, capsys)
    shard = src / "model-00001-of-00002.safetensors"
    _edit_same_size(shard, keep_mtime)
    assert convert_main(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("glm-convert: error: "), err
    assert shard.name in err and "changed" in err and "--force" in err
    assert ("sha256" in err) and (("mtime" in err) != keep_mtime)
    assert not (out / "manifest.json").exists()
    assert convert_main([*args, "--force"]) == 0  # starts over: the same container as a fresh conversion
    assert convert_main([str(src), str(tmp_path / "fresh"), *args[2:]]) == 0
    assert Container(out).model_hash == Container(tmp_path / "fresh").model_hash


def test_shard_identity_samples_a_large_shard(tmp_path):
    """Beyond SAMPLE_BLOCKS blocks, the header and evenly spaced blocks are hashed (from the first data byte to
    the last block); an edit there changes the identity, the file's mtime aside."""
    from glmkit.convert.sources.snapshot import SAMPLE_BLOCK_BYTES, SAMPLE_BLOCKS, shard_identity

    path = tmp_path / "big.safetensors"
    header = b'{"x":{"dtype":"U8","shape":[4194304],"data_offsets":[0,4194304]}}'
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4 << 20))
    assert path.stat().st_size > SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES * 2
    first = shard_identity(path)
    for offset in (20, 8 + len(header), path.stat().st_size - 1):  # header, first and last sampled bytes
        data = bytearray(path.read_bytes())
        data[offset] ^= 1
        path.write_bytes(bytes(data))
        changed = shard_identity(path)
        assert changed["sampled_sha256"] != first["sampled_sha256"] and changed["nbytes"] == first["nbytes"]
        data[offset] ^= 1
        path.write_bytes(bytes(data))
        assert shard_identity(path)["sampled_sha256"] == first["sampled_sha256"]


# --- non-finite or misread weights --------------------------------------------------------------------------------

def _poke(path, name: str, value: float, index: int = 5) -> None:
    """Overwrite element `index` (flat) of tensor `name` with `value`, encoded in the tensor's own dtype."""
    info = read_header(path)[name]
    item = np.array([value], np.float32).astype(info.np_dtype).tobytes()
    assert 0 <= index < info.nbytes // len(item)
    with open(path, "r+b") as f:
        f.seek(info.start + index * len(item))
        f.write(item)


def _header_one_byte_short(path) -> None:
    """Pad the JSON header with spaces (as the safetensors library does), then declare it one byte shorter:
    still valid JSON, but every tensor now starts one byte early."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    text = data[8:8 + n] + b"    "
    path.write_bytes((len(text) - 1).to_bytes(8, "little") + text + data[8 + n:])


def _source(tmp_path, kind: str):
    src = tmp_path / "src"
    if kind in ("tiny-fp8", "tiny-bf16"):
        shutil.copytree(FIXTURES / kind, src)
    else:
        make_snapshot(src, dtype="F16" if kind == "f16" else "BF16", fp8=kind == "fp8", fused=kind == "fused")
    return src


FP8_DENSE = "model.layers.0.mlp.gate_proj.weight"
NONFINITE_CASES = [  # (source, tensor, value, preset, shard, row-block streaming)
    ("bf16", "model.layers.0.self_attn.q_b_proj.weight", np.nan, "q4", "model.safetensors", False),
    ("bf16", "model.layers.0.self_attn.q_b_proj.weight", np.inf, "q4", "model.safetensors", False),
    ("bf16", "model.layers.2.self_attn.o_proj.weight", -np.inf, "f32", "model.safetensors", False),
    ("bf16", "model.layers.1.input_layernorm.weight", np.nan, "q4", "model.safetensors", False),
    ("bf16", "model.layers.1.mlp.gate.e_score_correction_bias", np.inf, "q4", "model.safetensors", False),
    ("bf16", "model.embed_tokens.weight", np.nan, "q8", "model.safetensors", True),
    ("f16", "lm_head.weight", np.inf, "q4", "model.safetensors", False),
    ("fused", "model.layers.2.mlp.experts.gate_up_proj", np.nan, "q4", "model.safetensors", False),
    ("fp8", FP8_DENSE, np.nan, "q4", "model.safetensors", False),
    ("fp8", FP8_DENSE.replace("weight", "weight_scale_inv"), np.nan, "q4", "model.safetensors", False),
    ("fp8", FP8_DENSE.replace("weight", "weight_scale_inv"), np.inf, "f32", "model.safetensors", True),
    ("fp8", FP8_DENSE.replace("weight", "weight_scale_inv"), 0.0, "q4", "model.safetensors", False),
    ("fp8", FP8_DENSE.replace("weight", "weight_scale_inv"), -0.5, "q4", "model.safetensors", False),
    ("tiny-fp8", "model.layers.1.mlp.experts.gate_up_proj", np.nan, "q4", "model.safetensors", False),
    ("tiny-fp8", "model.layers.2.mlp.experts.gate_up_proj_scale_inv", 0.0, "q4", "model.safetensors", False),
    ("tiny-fp8", "model.layers.3.mlp.experts.down_proj_scale_inv", np.nan, "q2", "model.safetensors", False),
]


@pytest.mark.parametrize("kind,tensor,value,preset,shard,streamed", NONFINITE_CASES)
def test_nonfinite_values_and_scales_are_refused(tmp_path, capsys, monkeypatch, kind, tensor, value, preset, shard,
                                                 streamed):
    from glmkit.convert import convert as convert_module

    if streamed:  # big tensors go through in row blocks: the check covers every block
        monkeypatch.setattr(convert_module, "STREAM_ELEMS", 512)
    src = _source(tmp_path, kind)
    index = 0 if "scale_inv" in tensor or "bias" in tensor else 5
    _poke(src / shard, tensor, value, index)
    err = run_bad(capsys, src, tmp_path / "out", "--preset", preset)
    assert tensor in err and shard in err and "--allow-nonfinite" in err
    assert ("scales" in err) == ("scale_inv" in tensor)


def test_header_length_one_byte_short_is_refused(tmp_path, capsys):
    src = _source(tmp_path, "bf16")
    _header_one_byte_short(src / "model.safetensors")
    err = run_bad(capsys, src, tmp_path / "out", "--preset", "f32")
    assert "model.safetensors" in err and "cover" in err


def test_allow_nonfinite_converts_them_as_they_are(tmp_path, capsys):
    src = _source(tmp_path, "fp8")
    name = "model.layers.2.self_attn.o_proj.weight"
    _poke(src / "model.safetensors", name, np.nan, 3)
    _poke(src / "model.safetensors", FP8_DENSE.replace("weight", "weight_scale_inv"), 0.0, 0)
    out = tmp_path / "out"
    assert convert_main([str(src), str(out), "--quiet", "--preset", "f32", "--allow-nonfinite"]) == 0
    c = Container(out)
    weight = c.weight(name)
    assert np.isnan(weight.reshape(-1)[3]) and np.isfinite(np.delete(weight.reshape(-1), 3)).all()
    assert not c.weight(FP8_DENSE)[:128].any() and c.weight(FP8_DENSE)[128:].any()  # its first block row: zero


# --- the tensors present must match config.json exactly -----------------------------------------------------------

def _synth(tmp_path, config: dict, weights: dict | None = None):
    src = tmp_path / "src"
    make_snapshot(src, weights=weights if weights is not None else make_weights(TINY_CONFIG))
    (src / "config.json").write_text(json.dumps(config))
    return src


@pytest.mark.parametrize("case,first", [
    ("one more layer", "model.layers.4.eh_proj.weight"),  # the MTP layer would convert as decoder layer 4
    ("one layer less, no MTP", "model.layers.2.input_layernorm.weight"),  # layers 2 and 3 would vanish
    ("one layer less, MTP", "model.layers.2.eh_proj.weight"),  # decoder layer 2 would be the MTP layer
    ("MTP present but not configured", "model.layers.3.eh_proj.weight"),
    ("indexer on a shared layer", "model.layers.2.self_attn.indexer.k_norm.bias"),
])
def test_config_disagreeing_with_the_tensors_is_refused(tmp_path, capsys, case, first):
    if case == "one more layer":  # tiny-bf16 schedules its indexers by rule, so 5 layers stay a valid config
        src = tmp_path / "src"
        shutil.copytree(FIXTURES / "tiny-bf16", src)
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    else:
        changes = {"one layer less, no MTP": {"num_hidden_layers": 2, "indexer_types": ["full", "shared"],
                                              "num_nextn_predict_layers": 0},
                   "one layer less, MTP": {"num_hidden_layers": 2, "indexer_types": ["full", "shared"]},
                   "MTP present but not configured": {"num_nextn_predict_layers": 0},
                   "indexer on a shared layer": {"indexer_types": ["full", "shared", "shared"]}}[case]
        src = _synth(tmp_path, {**TINY_CONFIG, **changes})
    err = run_bad(capsys, src, tmp_path / "out")
    assert f"{first!r}" in err and "num_hidden_layers=" in err and "config.json" in err


def test_mtp_copies_of_the_embedding_and_head_are_tolerated(tmp_path):
    """Some exports copy the main embedding and lm_head into the MTP layer (DeepSeek-V3 style): the MTP layer
    reuses the main ones, so the copies are left out rather than refused."""
    weights = make_weights(TINY_CONFIG)
    weights["model.layers.3.embed_tokens.weight"] = weights["model.embed_tokens.weight"]
    weights["model.layers.3.shared_head.head.weight"] = weights["lm_head.weight"]
    out = tmp_path / "out"
    assert convert_main([str(_synth(tmp_path, TINY_CONFIG, weights)), str(out), "--quiet"]) == 0
    tensors = Container(out).manifest.tensors
    assert "model.layers.3.eh_proj.weight" in tensors and "model.layers.3.embed_tokens.weight" not in tensors
