import json

import numpy as np
import pytest
from safetensors import safe_open

from glmkit.cli.convert import main as convert_main
from glmkit.format.manifest import ALIGNMENT
from glmkit.format.packing import dequantize, unpack
from glmkit.format.reader import Container
from glmkit.format.safetensors_file import read_header
from tools.synth import TINY_CONFIG, make_snapshot, make_weights


def convert(src, out, *args):
    assert convert_main([str(src), str(out), "--quiet", *args]) == 0
    return Container(out)


@pytest.fixture(scope="module")
def sharded_source(tmp_path_factory):
    src = tmp_path_factory.mktemp("src") / "bf16"
    exact = make_snapshot(src, shards=3)
    return src, exact


@pytest.mark.parametrize("preset", ["f32", "q8", "q4", "q2"])
def test_stock_safetensors_reads_every_tensor(sharded_source, tmp_path, preset):
    src, _ = sharded_source
    c = convert(src, tmp_path / "out", "--preset", preset)
    seen = set()
    for fname in c.manifest.files:
        with safe_open(str(tmp_path / "out" / fname), "np") as f:
            for key in f.keys():
                if key.startswith("__pad."):
                    continue
                seen.add(key)
                np.testing.assert_array_equal(f.get_tensor(key).reshape(c.raw(key).shape), c.raw(key))
    assert seen == set(c.manifest.tensors)


def test_f32_preset_is_lossless(sharded_source, tmp_path):
    src, exact = sharded_source
    c = convert(src, tmp_path / "out", "--preset", "f32")
    assert set(c.manifest.tensors) == set(exact)
    for name, w in exact.items():
        np.testing.assert_array_equal(c.weight(name), w)


def test_q4_preset_classes(sharded_source, tmp_path):
    src, exact = sharded_source
    c = convert(src, tmp_path / "out")  # q4 is the default
    t = c.manifest.tensors
    expert = "model.layers.1.mlp.experts.2.up_proj.weight"
    assert (t[expert].quant.bits, t[expert].quant.group_size) == (4, 64)
    assert t[expert + ".qs"].shape == (24, 1)
    assert (t["model.layers.0.self_attn.q_b_proj.weight"].quant.bits, t["model.layers.0.mlp.down_proj.weight"]
            .quant.group_size) == (4, 64)
    for int8 in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.indexer.wk.weight",
                 "model.layers.3.eh_proj.weight", "model.layers.3.self_attn.q_a_proj.weight"):
        assert (t[int8].quant.bits, t[int8].quant.group_size) == (8, 64), int8
    for f32 in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                "model.norm.weight", "model.layers.2.self_attn.kv_a_layernorm.weight"):
        assert t[f32].quant is None and t[f32].dtype == "F32", f32
    assert "model.layers.1.self_attn.indexer.wk.weight" not in t  # layer 1 is a shared indexer layer
    assert c.manifest.conversion["quantizer"] == "mse" and c.manifest.conversion["grid"] == "nl"
    assert t[expert].quant.scheme == "nl4" and t["lm_head.weight"].quant.scheme == "symmetric"
    # absmax never clips: uniform codes are off by at most half a step; nl4 maps w / s into [-127, 127], where the
    # nearest level is at most 14 away (113 .. 127 above the top level)
    for grid, worst in (("uniform", 0.5), ("nl", 14)):
        w = convert(src, tmp_path / f"absmax-{grid}", "--quantizer", "absmax", "--grid", grid).weight(expert)
        assert w.scheme == ("nl4" if grid == "nl" else "symmetric")
        step = np.abs(np.repeat(w.scales, 64, axis=1)[:, :32])
        assert np.all(np.abs(w.dequantize() - exact[expert]) <= step * worst + 1e-6)
        # the default mse quantizer may clip, but its squared error is never larger
        mse = c if grid == "nl" else convert(src, tmp_path / "mse-uniform", "--grid", "uniform")
        error = ((mse.weight(expert).dequantize() - exact[expert]) ** 2).sum()
        assert error <= ((w.dequantize() - exact[expert]) ** 2).sum()


def test_q2_and_overrides(sharded_source, tmp_path):
    src, _ = sharded_source
    t = convert(src, tmp_path / "q8", "--preset", "q8").manifest.tensors
    assert t["model.embed_tokens.weight"].quant is None and t["model.embed_tokens.weight"].dtype == "F32"  # a lookup
    # q8: groups of 32 for every role but the routed experts (64); an explicit --group-size applies to all
    for name, group in (("lm_head.weight", 32), ("model.layers.2.self_attn.o_proj.weight", 32),
                        ("model.layers.2.mlp.shared_experts.gate_proj.weight", 32),
                        ("model.layers.2.mlp.experts.0.gate_proj.weight", 64)):
        assert (t[name].quant.bits, t[name].quant.group_size) == (8, group), name
    t = convert(src, tmp_path / "q8-g64", "--preset", "q8", "--group-size", "64").manifest.tensors
    assert {e.quant.group_size for e in t.values() if e.quant is not None} == {64}
    c = convert(src, tmp_path / "q2", "--preset", "q2")
    assert c.manifest.tensors["model.layers.2.mlp.experts.0.gate_proj.weight"].quant.bits == 2
    assert c.manifest.tensors["model.layers.2.mlp.shared_experts.gate_proj.weight"].quant.bits == 4
    c = convert(src, tmp_path / "ovr", "--expert-bits", "8", "--dense-bits", "32", "--group-size", "0")
    t = c.manifest.tensors
    assert t["model.layers.2.mlp.experts.0.gate_proj.weight"].quant.bits == 8
    assert t["model.layers.2.self_attn.o_proj.weight"].quant is None
    c = convert(src, tmp_path / "perrow", "--group-size", "0")
    for name, bits in (("model.layers.2.mlp.experts.0.gate_proj.weight", 4), ("lm_head.weight", 8)):
        q = c.manifest.tensors[name].quant
        assert (q.bits, q.group_size) == (bits, None), name


def test_q3_preset(sharded_source, tmp_path):
    """Routed experts int3 g64 (24 bytes per 64 columns), everything else as q4; each int3 weight is its codes
    times its scales, never further from the source than half a step plus the clipping the mse search chose."""
    src, exact = sharded_source
    c = convert(src, tmp_path / "q3", "--preset", "q3")
    t = c.manifest.tensors
    expert, down = "model.layers.2.mlp.experts.0.gate_proj.weight", "model.layers.2.mlp.experts.0.down_proj.weight"
    assert (t[expert].quant.bits, t[expert].quant.group_size) == (3, 64)
    assert t[down].stored_shape == (t[down].shape[0], 24 * -(-t[down].shape[1] // 64))
    assert t["model.layers.2.mlp.shared_experts.gate_proj.weight"].quant.bits == 4
    assert t["lm_head.weight"].quant.bits == 8 and c.manifest.conversion["bits"]["routed_expert"] == 3
    w = c.weight(expert)
    codes = unpack(w.packed, 3, w.shape[1])
    assert codes.min() >= -4 and codes.max() <= 3 and len(np.unique(codes)) == 8
    np.testing.assert_array_equal(w.dequantize(), codes * np.repeat(w.scales, 64, axis=1)[:, :w.shape[1]])
    err = ((w.dequantize() - exact[expert]) ** 2).sum()
    absmax = convert(src, tmp_path / "q3abs", "--preset", "q3", "--quantizer", "absmax").weight(expert)
    assert err <= ((absmax.dequantize() - exact[expert]) ** 2).sum()
    # this model's rows are 24-32 wide: each int3 row is one padded block (GLM-5's 2,048-6,144 are whole blocks)
    assert t[expert].nbytes == t[expert].shape[0] * 24


@pytest.mark.parametrize("preset", ["f32", "q4"])
def test_alignment_and_expert_contiguity(sharded_source, tmp_path, preset):
    src, _ = sharded_source
    c = convert(src, tmp_path / "out", "--preset", preset)
    for e in c.manifest.tensors.values():
        assert e.offset % ALIGNMENT == 0, e.name
        info = read_header(tmp_path / "out" / e.file)[e.name]  # the file's own header agrees
        assert (info.start, info.nbytes) == (e.offset, e.nbytes)
    cfg = c.config
    moe_layers = [i for i in range(cfg.num_layers_with_mtp) if cfg.is_moe_layer(i)]
    assert len(c.manifest.experts) == len(moe_layers) * cfg.n_routed_experts
    for r in c.manifest.experts:
        parts = [n for n, e in c.manifest.tensors.items() if f"layers.{r.layer}.mlp.experts.{r.expert}." in n]
        assert len(parts) == (3 if preset == "f32" else 6)
        spans = sorted((c.manifest.tensors[n].offset, c.manifest.tensors[n].nbytes) for n in parts)
        assert spans[0][0] == r.offset and spans[-1][0] + spans[-1][1] == r.offset + r.nbytes
        assert r.nbytes - sum(n for _, n in spans) < ALIGNMENT * len(spans)  # only alignment padding between
        assert all(c.manifest.tensors[n].file == r.file for n in parts)


def test_deterministic_output_and_hash(sharded_source, tmp_path):
    src, _ = sharded_source
    a = convert(src, tmp_path / "a")
    b = convert(src, tmp_path / "b")
    assert a.model_hash == b.model_hash
    for fname in a.manifest.files:
        assert (tmp_path / "a" / fname).read_bytes() == (tmp_path / "b" / fname).read_bytes()
    c = convert(src, tmp_path / "c", "--preset", "q8")
    assert c.model_hash != a.model_hash


def test_small_output_files_never_split_an_expert(sharded_source, tmp_path):
    src, _ = sharded_source
    c = convert(src, tmp_path / "out", "--preset", "f32", "--max-file-size", "40K")
    assert len(c.manifest.files) > 1
    names = sorted(c.manifest.files)
    assert names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    full = convert(src, tmp_path / "one", "--preset", "f32")
    for name in full.manifest.tensors:
        np.testing.assert_array_equal(c.weight(name), full.weight(name))


def test_fused_experts_and_single_file_equal_per_expert(tmp_path):
    per = make_snapshot(tmp_path / "per", shards=2)
    make_snapshot(tmp_path / "fused", fused=True, shards=1)
    a = convert(tmp_path / "per", tmp_path / "a")
    b = convert(tmp_path / "fused", tmp_path / "b")
    assert {n: e.sha256 for n, e in a.manifest.tensors.items()} == {n: e.sha256 for n, e in b.manifest.tensors.items()}
    assert set(per) <= set(a.manifest.tensors)


def test_fp8_source_dequantizes_blocks(tmp_path):
    exact = make_snapshot(tmp_path / "fp8", fp8=True)
    c = convert(tmp_path / "fp8", tmp_path / "out", "--preset", "f32")
    # the 136-row dense MLP weights span two 128-row blocks
    for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.2.mlp.experts.3.down_proj.weight"):
        np.testing.assert_array_equal(c.weight(name), exact[name])
    assert c.manifest.tensors["model.layers.0.mlp.gate_proj.weight"].shape == (136, 32)


def test_source_without_mtp_converts_without_it(tmp_path, capsys):
    weights = {n: w for n, w in make_weights(TINY_CONFIG).items()
               if not n.startswith("model.layers.3.")}
    make_snapshot(tmp_path / "nomtp", weights=weights)
    c = convert(tmp_path / "nomtp", tmp_path / "out")
    assert not any(n.startswith("model.layers.3.") for n in c.manifest.tensors)
    assert c.manifest.conversion["mtp"] is False
    assert "no MTP" in capsys.readouterr().err


def test_side_files_and_manifest_fields(sharded_source, tmp_path):
    src, _ = sharded_source
    c = convert(src, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == TINY_CONFIG
    assert (tmp_path / "out" / "generation_config.json").is_file()
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["format"] == "glmkit-container" and m["format_version"] == 1
    assert len(m["source"]["files"]) == 3 and all(len(f["sha256"]) == 64 for f in m["source"]["files"].values())
    assert m["conversion"]["preset"] == "q4" and m["conversion"]["group_size"] == 64
    assert "group_sizes" not in m["conversion"]  # a plan without per-role groups records what it always did
    e = m["tensors"]["model.layers.2.mlp.experts.1.down_proj.weight"]
    assert e["quant"] == {"bits": 4, "group_size": 64, "scales": "model.layers.2.mlp.experts.1.down_proj.weight.qs",
                          "scheme": "nl4"}
    assert m["tensors"]["lm_head.weight"]["quant"]["scheme"] == "symmetric" and m["conversion"]["grid"] == "nl"
    assert e["role"] == "routed_expert" and e["shape"] == [32, 24] and e["dtype"] == "U8"
    assert not list((tmp_path / "out").glob("*.tmp"))
    assert c.verify_data() == []


def test_quantized_weight_matches_its_own_dequantization(sharded_source, tmp_path):
    src, exact = sharded_source
    c = convert(src, tmp_path / "out", "--preset", "q2")
    name = "model.layers.2.mlp.experts.1.gate_proj.weight"
    w = c.weight(name)
    np.testing.assert_array_equal(w.dequantize(), dequantize(w.packed, w.scales, 2, 64, 32))
    assert np.abs(w.dequantize() - exact[name]).max() < np.abs(exact[name]).max()


def test_source_digests_run_beside_the_conversion_and_stop_on_request(tmp_path):
    """Local shards are hashed on a background thread while tensors convert; the manifest gets the same digests,
    and a stopped hashing (a failed conversion) ends at the next chunk."""
    import hashlib
    import threading

    from glmkit.convert.sources.open import open_source
    from glmkit.convert.sources.snapshot import DigestsStopped, sha256_file
    from glmkit.convert.sources.source import BackgroundDigests

    src = tmp_path / "src"
    make_snapshot(src, TINY_CONFIG, shards=2, seed=3)
    source = open_source(str(src))
    background = BackgroundDigests(source).result()
    assert background == source.digests() and len(background) == 2
    for name, digest in background.items():
        assert digest["sha256"] == hashlib.sha256((src / name).read_bytes()).hexdigest()
    out = tmp_path / "out"
    assert convert_main([str(src), str(out), "--preset", "q4", "--quiet"]) == 0
    assert Container(out).manifest.source["files"] == background
    stop = threading.Event()
    stop.set()
    with pytest.raises(DigestsStopped):
        sha256_file(next(iter(src.glob("*.safetensors"))), stop=stop)


@pytest.mark.parametrize("variant", ["tiny-bf16", "tiny-fp8"])
def test_row_block_streaming_writes_the_same_container(variant, tmp_path, monkeypatch):
    """Big tensors go through in row blocks (FP8: whole 128-row scale blocks); the bytes and the hash are those
    of converting each tensor at once, for F32 output and every scale quantizer."""
    from glmkit.convert import convert as convert_module
    from tests.runtime_support import FIXTURES

    source = FIXTURES / variant
    for args in (["--preset", "f32"], ["--preset", "q8"], ["--preset", "q4"],
                 ["--preset", "q2", "--quantizer", "absmax"], ["--preset", "q4", "--group-size", "0"]):
        monkeypatch.setattr(convert_module, "STREAM_ELEMS", 1 << 30)
        whole = tmp_path / "whole"
        assert convert_main([str(source), str(whole), "--quiet", "--force", *args]) == 0
        monkeypatch.setattr(convert_module, "STREAM_ELEMS", 2000)  # 128-row blocks at most, most tensors split
        blocks = tmp_path / "blocks"
        assert convert_main([str(source), str(blocks), "--quiet", "--force", *args]) == 0
        assert Container(blocks).model_hash == Container(whole).model_hash, args


def test_bench_model_rebuilds_a_container_whose_preset_changed(sharded_source, tmp_path):
    """tools/bench_model.py reuses a converted container only while it matches today's preset layout."""
    from tools.bench_model import layout_is_current

    src, _ = sharded_source
    out = convert(src, tmp_path / "q4").directory
    assert layout_is_current(out, "q4") and not layout_is_current(out, "q8")
    assert not layout_is_current(convert(src, tmp_path / "perrow", "--group-size", "0").directory, "q4")
