"""The trained fixture: exact at f32; glm-perplexity (KL against a saved base) and calibrated conversion."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from glmkit.cli import calibrate as calibrate_cli
from glmkit.cli import perplexity as perplexity_cli
from glmkit.cli.calibrate import main as calibrate_main
from glmkit.cli.common import engine_from_arguments
from glmkit.cli.convert import main as convert_main
from glmkit.cli.perplexity import main as perplexity_main
from glmkit.cli.validate import main as validate_main
from glmkit.errors import GlmkitError
from glmkit.format.imatrix import read_imatrix
from glmkit.format.reader import Container
from tests.runtime_support import FIXTURES, Snapshots

TRAINED = FIXTURES / "tiny-trained"
EVAL = TRAINED / "eval_tokens.json"
CALIB = TRAINED / "calib_tokens.json"
KL_FIELDS = {"tokens", "ppl", "kld_mean", "kld_p99", "top1_agreement", "top1_se", "ppl_ratio"}


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    return Snapshots(tmp_path_factory)


@pytest.fixture(scope="module")
def base(snapshots, tmp_path_factory):
    """The f32 conversion's log-probabilities over the first 6 held-out windows."""
    path = tmp_path_factory.mktemp("base") / "base.safetensors"
    code, out, _ = run(perplexity_main, snapshots("tiny-trained", "f32"), "--tokens", EVAL, "--max-windows", "6",
                       "--save-logits", path, "--json", "--quiet")
    assert code == 0
    return path, json.loads(out)


@pytest.fixture(scope="module")
def imatrix(snapshots, tmp_path_factory):
    path = tmp_path_factory.mktemp("imatrix") / "imatrix.safetensors"
    code, out, _ = run(calibrate_main, snapshots("tiny-trained", "f32"), "--tokens", CALIB, "--max-windows", "4",
                       "-o", path, "--quiet")
    assert code == 0 and "250 weights (186 with Hessians, 32 distinct) from 512 tokens" in out
    values = read_imatrix(path).values
    assert {"model.layers.4.eh_proj.weight", "model.layers.4.mlp.experts.3.down_proj.weight",  # MTP layer too
            "model.layers.1.self_attn.indexer.wq_b.weight", "lm_head.weight"} <= set(values)
    assert sum(f"layers.2.mlp.experts.{e}.gate_proj" in n for n in values for e in range(16)) >= 12
    assert values["model.layers.2.mlp.experts.5.down_proj.weight"].shape == (96,)
    return path


def run(main, *args) -> tuple[int, str, str]:
    """Run a CLI's main; the runtime CLIs on the NumPy reference (deterministic, no device measuring)."""
    argv = [str(a) for a in args] + (["--device", "numpy"] if main is not convert_main else [])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def convert(out: Path, *args) -> Path:
    code, _, err = run(convert_main, TRAINED, out, "--quiet", *args)
    assert code == 0, err
    return out


def test_trained_f32_passes_validate_exactly(snapshots):
    code, out, err = run(validate_main, snapshots("tiny-trained", "f32"), TRAINED / "oracle.json", "--json")
    result = json.loads(out)
    assert code == 0, (out, err)
    assert result["teacher_forcing"]["match"] == result["teacher_forcing"]["total"] == 80
    assert result["mtp"]["match"] == result["mtp"]["total"]
    assert result["greedy"]["mtp"] and result["greedy"]["mtp_acceptance"] > 0.3  # a trained MTP head drafts well


def test_fixture_is_a_trained_quality_reference():
    config = json.loads((TRAINED / "config.json").read_text())
    windows = json.loads(EVAL.read_text())
    assert config["n_routed_experts"] == 16 and config["num_nextn_predict_layers"] == 1
    assert min(len(w) for w in windows) > config["index_topk"]  # DSA is sparse in every window
    training = json.loads((TRAINED / "training.json").read_text())
    assert training["final_loss"] < 3.0 and set(training["data"]["eval_files"]).isdisjoint({"textwrap.py"})


def test_perplexity_json_fields_and_self_comparison(snapshots, base):
    path, f32 = base
    assert set(f32) == {"tokens", "ppl"} and f32["tokens"] == 6 * 127 and 1 < f32["ppl"] < 40
    code, out, _ = run(perplexity_main, snapshots("tiny-trained", "f32"), "--tokens", EVAL, "--max-windows", "6",
                       "--kl-base", path, "--json", "--quiet")
    same = json.loads(out)
    assert code == 0 and set(same) == KL_FIELDS
    assert same["kld_mean"] == 0 and same["kld_p99"] == 0 and same["top1_agreement"] == 1 and same["ppl_ratio"] == 1


def test_quantized_kl_nl4_beats_uniform_and_gptq_beats_mse(base, imatrix, tmp_path):
    path, f32 = base
    results = {}
    for quantizer in ("absmax", "mse", "gptq"):
        extra = ("--imatrix", imatrix) if quantizer == "gptq" else ()
        snap = convert(tmp_path / quantizer, "--preset", "q4", "--quantizer", quantizer, *extra)
        code, out, _ = run(perplexity_main, snap, "--tokens", EVAL, "--max-windows", "6", "--kl-base", path,
                           "--json", "--quiet")
        assert code == 0
        results[quantizer] = r = json.loads(out)
        assert set(r) == KL_FIELDS and r["kld_mean"] > 0 and r["kld_p99"] >= r["kld_mean"]
        assert 0.5 < r["top1_agreement"] < 1 and r["ppl"] / f32["ppl"] == pytest.approx(r["ppl_ratio"])
    assert results["gptq"]["kld_mean"] < 0.85 * results["mse"]["kld_mean"]  # docs/QUALITY.md: -32% on all 320 windows
    # the default (mse over the nl4 grid), and nl4 with absmax scales, against uniform int4 codes with absmax scales
    # (--grid uniform): the same bytes. (mse against nl4's absmax: -9% on all 320 windows, within noise on these 6)
    uniform = convert(tmp_path / "uniform", "--preset", "q4", "--grid", "uniform", "--quantizer", "absmax")
    assert Container(uniform).nbytes == Container(tmp_path / "absmax").nbytes
    code, out, _ = run(perplexity_main, uniform, "--tokens", EVAL, "--max-windows", "6", "--kl-base", path, "--json",
                       "--quiet")
    assert code == 0
    uniform_absmax = json.loads(out)["kld_mean"]
    assert results["mse"]["kld_mean"] < 0.8 * uniform_absmax  # docs/QUALITY.md: -35% on all 320 windows
    assert results["absmax"]["kld_mean"] < uniform_absmax
    # human output names the comparison
    code, out, _ = run(perplexity_main, tmp_path / "mse", "--tokens", EVAL, "--max-windows", "6", "--kl-base", path,
                       "--quiet")
    assert code == 0 and "KL divergence mean" in out and "top-1 agreement" in out


def test_q3_sits_between_q4_and_q2(base, tmp_path):
    """--preset q3 (int3 experts) against f32: closer than q2, within reach of q4 (docs/QUALITY.md, all 320 windows:
    0.053 against 0.032 and 0.165)."""
    path, _ = base
    kl = {}
    for preset in ("q4", "q3", "q2"):
        code, out, _ = run(perplexity_main, convert(tmp_path / preset, "--preset", preset), "--tokens", EVAL,
                           "--max-windows", "6", "--kl-base", path, "--json", "--quiet")
        assert code == 0
        kl[preset] = json.loads(out)["kld_mean"]
    assert kl["q4"] < kl["q3"] <= 0.5 * kl["q2"] and kl["q3"] <= 2.5 * kl["q4"], kl


def test_perplexity_refuses_a_base_made_from_other_tokens(snapshots, base, tmp_path):
    path, _ = base
    other = tmp_path / "other.json"
    windows = json.loads(EVAL.read_text())[:6]
    windows[2][5] = (windows[2][5] + 1) % 300
    other.write_text(json.dumps(windows))
    for args in (("--tokens", other), ("--tokens", EVAL, "--max-windows", "5")):
        code, out, err = run(perplexity_main, snapshots("tiny-trained", "f32"), *args, "--kl-base", path, "--quiet")
        assert code == 1 and out == ""
        assert err.startswith("glm-perplexity: error: ") and "other tokens" in err and err.count("\n") == 1


def test_perplexity_bad_inputs(snapshots, tmp_path):
    snap = snapshots("tiny-trained", "f32")
    cases = {
        "notjson.json": "[[1, 2",
        "notlist.json": '{"a": 1}',
        "short.json": "[[1]]",
        "range.json": "[[1, 2, 384]]",
        "bools.json": "[[true, 2, 3]]",
        "deep.json": "[" * 10_000 + "]" * 10_000,
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        code, out, err = run(perplexity_main, snap, "--tokens", tmp_path / name, "--quiet")
        assert code == 1 and out == "" and err.startswith("glm-perplexity: error: ") and err.count("\n") == 1, name
    (tmp_path / "tiny.txt").write_text("def f():\n    return 1\n")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 " * 200)
    for args in (("--tokens", tmp_path / "missing.json"), ("--text", tmp_path / "tiny.txt"),
                 ("--text", tmp_path / "latin1.txt"), ("--text", tmp_path / "tiny.txt", "--ctx", "1"),
                 ("--tokens", EVAL, "--max-windows", "0"), ("--tokens", EVAL, "--kl-base", tmp_path / "tiny.txt"),
                 ("--tokens", EVAL, "--kl-base", tmp_path / "missing.st")):
        code, out, err = run(perplexity_main, snap, *args, "--quiet")
        assert code == 1 and err.startswith("glm-perplexity: error: ") and err.count("\n") == 1, args
    code, _, err = run(perplexity_main, tmp_path / "nothing", "--tokens", EVAL)
    assert code == 1 and err.startswith("glm-perplexity: error: ")


@pytest.mark.parametrize("where", ["a directory", "in a missing directory"])
@pytest.mark.parametrize("cli", ["glm-perplexity", "glm-calibrate"])
def test_an_output_no_file_can_take_is_refused_before_the_work(snapshots, tmp_path, monkeypatch, cli, where):
    """`--save-logits` / `-o` onto a directory or into a missing one: one line before the model is opened (the
    file is renamed into place only when the work is done), and nothing left behind."""
    snap = snapshots("tiny-trained", "f32")
    module, flag, tokens = ((perplexity_cli, "--save-logits", EVAL) if cli == "glm-perplexity"
                            else (calibrate_cli, "-o", CALIB))
    target = tmp_path / "out.safetensors" if where == "a directory" else tmp_path / "missing" / "out.safetensors"
    if where == "a directory":
        target.mkdir()
    monkeypatch.setattr(module, "engine_from_arguments", lambda *a, **k: pytest.fail("opened the model"))
    code, out, err = run(module.main, snap, "--tokens", tokens, "--max-windows", "1", flag, target, "--quiet")
    why = "Is a directory" if where == "a directory" else f"no directory {target.parent}"
    assert code == 1 and out == "" and err == f"{cli}: error: {flag}: cannot write {target} ({why})\n"
    assert list(tmp_path.rglob("*")) == ([target] if where == "a directory" else [])



def test_a_negative_hessian_width_is_refused_before_the_work(snapshots, tmp_path, monkeypatch):
    monkeypatch.setattr(calibrate_cli, "engine_from_arguments", lambda *a, **k: pytest.fail("opened the model"))
    code, out, err = run(calibrate_main, snapshots("tiny-trained", "f32"), "--tokens", CALIB, "-o",
                         tmp_path / "im.safetensors", "--max-hessian-dim", "-1", "--quiet")
    assert code == 1 and out == "" and err == "glm-calibrate: error: --max-hessian-dim: must be >= 0, got -1\n"
    assert list(tmp_path.iterdir()) == []

def test_imatrix_onto_a_directory_made_since_is_an_error_leaving_nothing(imatrix, tmp_path):
    target = tmp_path / "imatrix.safetensors"
    target.mkdir()
    with pytest.raises(GlmkitError, match=f"{target}: cannot write"):
        read_imatrix(imatrix).write(target)
    assert list(tmp_path.iterdir()) == [target]


def test_perplexity_and_calibrate_take_float_activations(snapshots, tmp_path):
    """`--float-activations` (shared with glm-run, glm-serve, glm-validate) reaches the engine's backend."""
    snap = snapshots("tiny-trained", "f32")
    # an OpenCL CPU backend pins OpenBLAS to one thread for the process: restored here, since BLAS's thread count
    # changes a product's rounding, and later tests compare conversions bit for bit
    with threadpool_limits(limits=None, user_api="blas"):
        for cli, rest in ((perplexity_cli, []), (calibrate_cli, ["-o", str(tmp_path / "imatrix.safetensors")])):
            argv = [str(snap), "--tokens", str(EVAL), "--device", "opencl", *rest]
            for flags, int8 in (([], True), (["--float-activations"], False)):
                engine = engine_from_arguments(cli.build_parser().parse_args(argv + flags), load_tokenizer=False)
                assert engine.device.startswith("opencl:") and engine.backend.int8_activations is int8, (cli, flags)


def test_perplexity_on_text(snapshots, tmp_path):
    text = tmp_path / "code.py"
    text.write_text("".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(40)))
    code, out, _ = run(perplexity_main, snapshots("tiny-trained", "f32"), "--text", text, "--ctx", "64", "--json",
                       "--quiet")
    result = json.loads(out)
    assert code == 0 and result["tokens"] % 63 == 0 and result["tokens"] >= 63 and result["ppl"] < 100


def test_calibrated_conversion_differs_and_still_runs(snapshots, imatrix, tmp_path):
    plain = Container(convert(tmp_path / "plain", "--preset", "q4"))
    calibrated = Container(convert(tmp_path / "cal", "--preset", "q4", "--imatrix", imatrix))
    f32 = Container(snapshots("tiny-trained", "f32"))
    rec = calibrated.manifest.conversion
    assert rec["quantizer"] == "mse" and len(rec["imatrix"]["sha256"]) == 64 and rec["imatrix"]["tokens"] == 512
    assert calibrated.model_hash != plain.model_hash
    assert {n: e.shape for n, e in calibrated.manifest.tensors.items() if e.role != "scales"} == {
        n: e.shape for n, e in f32.manifest.tensors.items()}
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    assert not np.array_equal(calibrated.weight(name).scales, plain.weight(name).scales)
    code, out, _ = run(validate_main, tmp_path / "cal", TRAINED / "oracle.json", "--min-agreement", "0", "--json")
    tf = json.loads(out)["teacher_forcing"]
    assert code == 0 and tf["match"] >= 0.8 * tf["total"], out


def test_imatrix_misuse_is_refused(imatrix, tmp_path):
    code, _, err = run(convert_main, TRAINED, tmp_path / "a", "--preset", "q4", "--quantizer", "absmax",
                       "--imatrix", imatrix, "--quiet")
    assert code == 1 and "--imatrix" in err
    code, _, err = run(convert_main, FIXTURES / "tiny-bf16", tmp_path / "b", "--imatrix", imatrix, "--quiet")
    assert code == 1 and "another model" in err
    (tmp_path / "bogus.st").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    code, _, err = run(convert_main, TRAINED, tmp_path / "c", "--imatrix", tmp_path / "bogus.st", "--quiet")
    assert code == 1 and "not a glmkit imatrix" in err


def test_imatrix_hessians(imatrix):
    im = read_imatrix(imatrix)
    layer = "model.layers.1."
    shared_input = [layer + "self_attn.q_a_proj.weight", layer + "self_attn.kv_a_proj_with_mqa.weight"]
    assert im.hessians[shared_input[0]] == im.hessians[shared_input[1]]  # the same input rows: one Hessian
    gate, up = (f"model.layers.2.mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up"))
    assert im.hessians[gate] == im.hessians[up] != im.hessians[shared_input[0]]
    # --hessians pooled: a routed expert's gate/up share its layer's MoE-input Hessian (the shared expert's)
    routed = {n: t for n, t in im.hessians.items() if ".mlp.experts." in n}
    assert routed and all(n.startswith("model.layers.") and "down_proj" not in n for n in routed)
    assert all(t == im.hessians[n.split("mlp.experts.")[0] + "mlp.shared_experts.gate_proj.weight"]
               for n, t in routed.items())
    assert set(routed) == {n for n in im.values if ".mlp.experts." in n and "down_proj" not in n}
    assert {"lm_head.weight", "model.layers.4.eh_proj.weight", layer + "self_attn.o_proj.weight"} <= set(im.hessians)
    for name in (shared_input[0], gate, "lm_head.weight", layer + "self_attn.indexer.wq_b.weight"):
        h = im.hessian(name)
        assert h is not None and h.shape == (im.values[name].shape[0],) * 2
        np.testing.assert_allclose(np.diag(h), im.values[name], rtol=1e-5)  # its diagonal is the imatrix
        np.testing.assert_allclose(h, h.T, rtol=1e-5, atol=1e-6)
        assert np.linalg.eigvalsh(h.astype(np.float64)).min() > -1e-4 * np.abs(h).max()
    assert im.hessian(f"{layer}mlp.gate_proj.weight") is None or layer == "model.layers.1."


def test_imatrix_digest_is_of_content(imatrix, tmp_path):
    """Saved again (safetensors writes its metadata in hash-map order), the digest and the statistics stay."""
    first = read_imatrix(imatrix)
    first.write(tmp_path / "again.st")
    second = read_imatrix(tmp_path / "again.st")
    assert second.sha256 == first.sha256 and second.hessians == first.hessians and second.counts == first.counts
    assert all(np.array_equal(second.values[n], v) for n, v in first.values.items())
    name = "lm_head.weight"
    np.testing.assert_array_equal(second.hessian(name), first.hessian(name))
    changed = read_imatrix(tmp_path / "again.st")
    changed.values[name] = changed.values[name] * 2
    changed.write(tmp_path / "changed.st")
    assert read_imatrix(tmp_path / "changed.st").sha256 != first.sha256


def test_calibrate_hessian_choices(snapshots):
    from glmkit.eval.calibration import collect_imatrix
    from glmkit.generate.engine import Engine

    engine = Engine(snapshots("tiny-trained", "f32"), "numpy", load_tokenizer=False)
    windows = json.loads(CALIB.read_text())[:2]
    full = collect_imatrix(engine, windows, hessians="all")
    gate, up, down = (f"model.layers.2.mlp.experts.5.{p}_proj.weight" for p in ("gate", "up", "down"))
    assert full.hessians[gate] == full.hessians[up] != full.hessians[down]
    assert full.hessian_data[full.hessians[down]].shape == (96, 96)
    none = collect_imatrix(engine, windows, hessians="none")
    assert none.hessians == {} and none.hessian_data == {}
    np.testing.assert_array_equal(none.values[gate], full.values[gate])
    dense = collect_imatrix(engine, windows, hessians="dense")
    assert dense.hessians and not any(".mlp.experts." in n for n in dense.hessians)
    pooled = collect_imatrix(engine, windows, hessians="pooled")
    assert pooled.hessians[gate] == pooled.hessians[up] == pooled.hessians["model.layers.2.mlp.shared_experts."
                                                                           "up_proj.weight"]
    assert down not in pooled.hessians and pooled.hessian_data.keys() == dense.hessian_data.keys()
    np.testing.assert_allclose(pooled.hessian(gate), full.hessian("model.layers.2.mlp.shared_experts.gate_proj.weight"),
                               rtol=1e-6)  # the layer's input over all tokens, not expert 5's
    narrow = collect_imatrix(engine, windows, hessians="pooled", max_hessian_dim=100)
    assert narrow.hessians and all(full.values[n].shape[0] <= 100 for n in narrow.hessians)
    assert any(v.shape[0] > 100 for v in narrow.values.values())


def test_imatrix_hostile_files(imatrix, tmp_path):
    from safetensors.numpy import load_file, save_file

    from glmkit.format.safetensors_file import read_metadata

    tensors = load_file(str(imatrix))
    meta = read_metadata(imatrix)
    hessians = json.loads(meta["hessians"])
    name = "lm_head.weight"
    cases = {
        "missing": ({k: v for k, v in tensors.items() if k != hessians[name]}, meta),
        "width": ({**tensors, hessians[name]: np.eye(5, dtype=np.float32)}, meta),
        "notsquare": ({**tensors, hessians[name]: np.zeros((5, 6), np.float32)}, meta),
        "badmeta": (tensors, {**meta, "hessians": "[1, 2]"}),
        "version": (tensors, {**meta, "format_version": "3"}),
    }
    for label, (t, m) in cases.items():
        path = tmp_path / f"{label}.st"
        save_file(t, str(path), metadata=m)
        code, out, err = run(convert_main, TRAINED, tmp_path / label, "--quantizer", "gptq", "--imatrix", path,
                             "--quiet")
        assert code == 1 and err.startswith("glm-convert: error: ") and err.count("\n") == 1, (label, err)
        assert not (tmp_path / label).exists()
    v1 = tmp_path / "v1.st"  # version 1 (no Hessians) still reads: mse uses it, gptq says what is missing
    save_file({k: v for k, v in tensors.items() if not k.startswith("hessian.")}, str(v1),
              metadata={**{k: v for k, v in meta.items() if k != "hessians"}, "format_version": "1"})
    assert read_imatrix(v1).hessians == {}
    code, _, err = run(convert_main, TRAINED, tmp_path / "v1out", "--quantizer", "gptq", "--imatrix", v1, "--quiet")
    assert code == 1 and "no Hessians" in err
    nonfinite = dict(tensors)
    nonfinite[hessians[name]] = tensors[hessians[name]].copy()
    nonfinite[hessians[name]][0, 1] = np.inf
    save_file(nonfinite, str(tmp_path / "inf.st"), metadata=meta)
    code, _, err = run(convert_main, TRAINED, tmp_path / "inf", "--quantizer", "gptq", "--imatrix",
                       tmp_path / "inf.st", "--quiet")
    assert code == 1 and "non-finite" in err and "glm-convert: error: " in err
