"""The trained fixture: exact at f32; glm-perplexity (KL against a saved base) and calibrated conversion."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

from glmkit.convert.cli import main as convert_main
from glmkit.formats.imatrix import read_imatrix
from glmkit.formats.reader import Container
from glmkit.runtime.calibrate import main as calibrate_main
from glmkit.runtime.cli_perplexity import main as perplexity_main
from glmkit.runtime.cli_validate import main as validate_main
from tests.runtime_support import FIXTURES, Snapshots

TRAINED = FIXTURES / "tiny-trained"
EVAL = TRAINED / "eval_tokens.json"
CALIB = TRAINED / "calib_tokens.json"
KL_FIELDS = {"tokens", "ppl", "kld_mean", "kld_p99", "top1_agreement", "ppl_ratio"}


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
    assert code == 0 and "weights from 512 tokens" in out
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


def test_fixture_is_what_the_issue_asks_for():
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


def test_quantized_kl_and_mse_beats_absmax(base, tmp_path):
    path, f32 = base
    results = {}
    for quantizer in ("absmax", "mse"):
        snap = convert(tmp_path / quantizer, "--preset", "q4", "--quantizer", quantizer)
        code, out, _ = run(perplexity_main, snap, "--tokens", EVAL, "--max-windows", "6", "--kl-base", path,
                           "--json", "--quiet")
        assert code == 0
        results[quantizer] = r = json.loads(out)
        assert set(r) == KL_FIELDS and r["kld_mean"] > 0 and r["kld_p99"] >= r["kld_mean"]
        assert 0.5 < r["top1_agreement"] < 1 and r["ppl"] / f32["ppl"] == pytest.approx(r["ppl_ratio"])
    assert results["mse"]["kld_mean"] < results["absmax"]["kld_mean"]
    # human output names the comparison
    code, out, _ = run(perplexity_main, tmp_path / "mse", "--tokens", EVAL, "--max-windows", "6", "--kl-base", path,
                       "--quiet")
    assert code == 0 and "KL divergence mean" in out and "top-1 agreement" in out


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
