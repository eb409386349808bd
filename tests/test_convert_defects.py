"""Hostile and mistaken conversion inputs: OUT overlapping SOURCE, a source changed between a kill and the
resume, non-finite or misread weights, a config that disagrees with the tensors, untrusted JSON side files,
and rerunning a finished conversion."""

import contextlib
import hashlib
import json
import os
import resource
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

from glmkit.cli.convert import main as convert_main
from glmkit.convert.sources.snapshot import HFSnapshot
from glmkit.format.reader import Container
from glmkit.format.safetensors_file import read_header
from tests.runtime_support import FIXTURES, HUGE_INTEGER, fail_reading, with_huge_integer
from tests.test_convert_errors import run_bad
from tools.synth import TINY_CONFIG, make_snapshot, make_weights


def tree_digest(directory) -> dict[str, object]:
    """sha256 of every regular file under `directory` by relative path (of a file over 16 MB, size and mtime:
    the fuzz makes sparse ones of hundreds of MB, and any write changes the mtime)."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() if p.stat().st_size <= 16 << 20
            else (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(directory.rglob("*")) if p.is_file()}


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
    real = fail_reading(monkeypatch, "model.layers.3.")
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


def test_file_identity_samples_a_large_file(tmp_path):
    """Beyond SAMPLE_BLOCKS blocks, the header and evenly spaced blocks are hashed (from the first data byte to
    the last block); an edit there changes the identity, the file's mtime aside."""
    from glmkit.convert.sources.snapshot import SAMPLE_BLOCK_BYTES, SAMPLE_BLOCKS, file_identity

    path = tmp_path / "big.safetensors"
    header = b'{"x":{"dtype":"U8","shape":[4194304],"data_offsets":[0,4194304]}}'
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4 << 20))
    assert path.stat().st_size > SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES * 2
    first = file_identity(path)
    for offset in (20, 8 + len(header), path.stat().st_size - 1):  # header, first and last sampled bytes
        data = bytearray(path.read_bytes())
        data[offset] ^= 1
        path.write_bytes(bytes(data))
        changed = file_identity(path)
        assert changed["sampled_sha256"] != first["sampled_sha256"] and changed["nbytes"] == first["nbytes"]
        data[offset] ^= 1
        path.write_bytes(bytes(data))
        assert file_identity(path)["sampled_sha256"] == first["sampled_sha256"]


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


# --- config.json and the other JSON side files are untrusted ------------------------------------------------------

class Hang(Exception):
    """A conversion that ran past its time limit (a read that never ends)."""


@contextlib.contextmanager
def bounded(seconds: float = 10, memory: int = 1 << 30):
    """Run the body with a wall-clock limit (SIGALRM raises Hang) and at most `memory` more bytes of address
    space (a bigger allocation raises MemoryError), so a hang or a blow-up fails the test instead of the machine."""
    vm = int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                  if line.startswith("VmSize:")).split()[1]) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)

    def expire(signum, frame):
        raise Hang(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    resource.setrlimit(resource.RLIMIT_AS, (vm + memory, hard))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGALRM, previous)


def _replace(path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "generation_config.json",
                                  "tokenizer.json", "model-00002-of-00003.safetensors"])
@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_side_files_and_shards_must_be_regular_files(tmp_path, capsys, name, kind):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "tiny-bf16", src)
    _replace(src / name, kind)
    with bounded():
        err = run_bad(capsys, src, tmp_path / "out")
    assert name in err and "not a regular file" in err


def _nested(cfg: dict, depth: int) -> str:
    """config.json with one more key holding lists nested `depth` deep."""
    return json.dumps(cfg)[:-1] + ', "extra": ' + "[" * depth + "]" * depth + "}"


CONFIG_TEXT_CASES = {
    "nested 10^4 deep": lambda cfg: _nested(cfg, 10**4),
    "nested 100 deep": lambda cfg: _nested(cfg, 100),
    "over 16 MB": lambda cfg: json.dumps(cfg) + " " * (17 << 20),
    "duplicate key": lambda cfg: json.dumps(cfg)[:-1] + ', "num_hidden_layers": 4}',
    "not UTF-8": lambda cfg: json.dumps(cfg).replace("glm_moe_dsa", "glm_moe_dsa\udcff"),
    "an integer past the digit limit": lambda cfg: json.dumps(cfg)[:-1] + ', "extra": ' + HUGE_INTEGER + "}",
}


@pytest.mark.parametrize("case,expected", [
    ("nested 10^4 deep", "nested more than 64 levels"), ("nested 100 deep", "nested more than 64 levels"),
    ("over 16 MB", "more than the 16777216"), ("duplicate key", "'num_hidden_layers' appears twice"),
    ("not UTF-8", "not UTF-8"), ("an integer past the digit limit", "not valid JSON (Exceeds the limit"),
])
def test_config_text_is_untrusted(tmp_path, capsys, case, expected):
    src = _synth(tmp_path, TINY_CONFIG)
    text = CONFIG_TEXT_CASES[case](TINY_CONFIG)
    (src / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with bounded():
        err = run_bad(capsys, src, tmp_path / "out")
    assert "config.json" in err and expected in err


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer_config.json", "model.safetensors.index.json",
                                  "model-00002-of-00003.safetensors"])
def test_an_integer_past_the_digit_limit_in_a_source_file_is_one_line(tmp_path, capsys, name):
    src = Path(shutil.copytree(FIXTURES / "tiny-bf16", tmp_path / "src"))
    data = (src / name).read_bytes()
    if name.endswith(".safetensors"):  # the header grows: the tensors' offsets count from its end
        n = int.from_bytes(data[:8], "little")
        header = with_huge_integer(data[8:8 + n])
        data = len(header).to_bytes(8, "little") + header + data[8 + n:]
    else:
        data = with_huge_integer(data)
    (src / name).write_bytes(data)
    err = run_bad(capsys, src, tmp_path / "out")
    assert name in err and "JSON (Exceeds the limit" in err


@pytest.mark.parametrize("changes,field", [
    ({"norm_topk_prob": "false"}, "'norm_topk_prob'"),
    ({"rms_norm_eps": float("inf")}, "'rms_norm_eps'"),
    ({"routed_scaling_factor": float("nan")}, "'routed_scaling_factor'"),
    ({"rope_parameters": {"rope_theta": float("nan"), "rope_type": "default"}}, "rope_theta"),
    ({"eos_token_id": [1, 10**6]}, "eos_token_id"),
    ({"eos_token_id": -1}, "eos_token_id"),
    ({"indexer_types": [["full"], "shared", "full"]}, "indexer_types"),
    ({"num_hidden_layers": 1024, "n_routed_experts": 4096, "indexer_types": None}, "expert matrices"),
    ({"index_topk_freq": True, "indexer_types": None}, "index_topk_freq"),
    ({"hidden_size": 0}, "'hidden_size'"), ({"num_attention_heads": -4}, "'num_attention_heads'"),
    ({"vocab_size": 1.5}, "'vocab_size'"), ({"n_routed_experts": [4]}, "'n_routed_experts'"),
])
def test_config_fields_are_checked_before_anything_is_sized_from_them(tmp_path, capsys, changes, field):
    cfg = {k: v for k, v in {**TINY_CONFIG, **changes}.items() if v is not None}
    src = _synth(tmp_path, cfg)
    with bounded():
        err = run_bad(capsys, src, tmp_path / "out")
    assert "config.json" in err and field in err


# --- rerunning a finished conversion ------------------------------------------------------------------------------

def test_rerunning_a_finished_conversion_says_already_converted(tmp_path, capsys):
    src, out = tmp_path / "src", tmp_path / "out"
    make_snapshot(src, shards=2)
    args = [str(src), str(out), "--quiet", "--max-file-size", "64K"]
    assert convert_main(args) == 0
    model_hash = Container(out).model_hash
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()}
    capsys.readouterr()
    assert convert_main(args) == 0
    captured = capsys.readouterr()
    assert f"{out}: already converted (model hash {model_hash[:16]})" in captured.out and not captured.err
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()} == before  # nothing rewritten

    def refused(*extra: str) -> str:  # OUT keeps its finished container (run_bad's no-manifest check aside)
        assert convert_main([*args, *extra]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("glm-convert: error: ") and "--force" in err, err
        return err

    err = refused("--preset", "q8")
    assert "finished conversion of other inputs" in err and 'conversion.preset: "q4" in OUT vs "q8" now' in err
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-6}))
    assert "config.json differs" in refused()
    (src / "config.json").write_text(json.dumps(cfg))
    _edit_same_size(src / "model-00001-of-00002.safetensors", keep_mtime=False)
    assert "shard model-00001-of-00002.safetensors changed" in refused()
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()} == before
    assert convert_main([*args, "--force"]) == 0 and Container(out).model_hash != model_hash


# --- the resume state in OUT is untrusted too ---------------------------------------------------------------------

def test_resume_converts_again_a_completed_file_edited_since(tmp_path, monkeypatch, capsys):
    src, out, args = _interrupted(tmp_path, monkeypatch, capsys)
    done = [json.loads(line)["file"] for line in (out / ".glm-convert" / "done.jsonl").read_text().splitlines()]
    edited = out / done[1]
    data = bytearray(edited.read_bytes())
    data[-1] ^= 1
    edited.write_bytes(bytes(data))
    assert convert_main(args) == 0
    assert f"resuming {out}: 1 of " in capsys.readouterr().err  # only the file before it is kept
    assert Container(out).verify_data() == []
    assert convert_main([str(src), str(tmp_path / "fresh"), *args[2:]]) == 0
    assert Container(out).model_hash == Container(tmp_path / "fresh").model_hash


@pytest.mark.parametrize("damage", ["[" * 10**5, '{"identity": []}', '{"identity": {}, "x": ' + HUGE_INTEGER + "}",
                                    "fifo"])
def test_damaged_resume_state_is_an_error_that_force_gets_past(tmp_path, monkeypatch, capsys, damage):
    src, out, args = _interrupted(tmp_path, monkeypatch, capsys)
    state = out / ".glm-convert" / "state.json"
    if damage == "fifo":
        _replace(state, "fifo")
    else:
        state.write_text(damage)
    with bounded():
        assert convert_main(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "state.json" in err and "--force" in err, err
    with bounded():
        assert convert_main([*args, "--force"]) == 0
    Container(out)
