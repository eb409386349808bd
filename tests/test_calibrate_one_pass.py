"""glm-convert --calibrate: GPTQ statistics made layer by layer from the source while it is converted."""

from __future__ import annotations

import json

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from glmkit.backends.numpy_backend import NumpyBackend
from glmkit.cli.convert import main as convert_main
from glmkit.convert.quantizers import HessianFactor, gptq_quantize
from glmkit.convert.sources.snapshot import HFSnapshot
from glmkit.errors import GlmkitError
from glmkit.eval.layerwise import WORKERS, LayerwiseCalibration
from glmkit.format.packing import pack
from glmkit.format.reader import Container
from glmkit.format.schema import model_tensors
from glmkit.format.tensors import QuantWeight
from glmkit.generate.engine import Engine
from glmkit.model.glm5 import GlmMoeDsaModel
from tests.runtime_support import fail_reading
from tests.test_quality import CALIB, TRAINED, convert, run

WINDOWS = 2


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """The trained fixture at q4, calibrated in one pass over 2 windows of calib_tokens.json."""
    out = tmp_path_factory.mktemp("one-pass") / "q4"
    return convert(out, "--preset", "q4", "--calibrate", CALIB, "--calibrate-windows", str(WINDOWS))


def test_one_pass_container_runs_and_records_its_calibration(calibrated, tmp_path):
    container = Container(calibrated)
    record = container.manifest.conversion
    assert record["quantizer"] == "gptq" and "imatrix" not in record
    assert record["calibration"]["windows"] == WINDOWS and record["calibration"]["tokens"] == WINDOWS * 128
    assert record["calibration"]["propagate"] == "quantized"
    plain = Container(convert(tmp_path / "plain", "--preset", "q4"))
    assert {n: (e.shape, e.dtype) for n, e in container.manifest.tensors.items()} == {
        n: (e.shape, e.dtype) for n, e in plain.manifest.tensors.items()}  # same layout, other codes
    assert container.model_hash != plain.model_hash
    engine = Engine(calibrated, "numpy", load_tokenizer=False)
    ids = np.asarray(json.loads(CALIB.read_text())[-1][:32])
    logits, _ = engine.model.forward(ids, engine.model.new_cache())
    assert np.isfinite(logits).all()
    # same command again: already converted, nothing rewritten
    code, out, _ = run(convert_main, TRAINED, calibrated, "--preset", "q4", "--calibrate", CALIB,
                       "--calibrate-windows", str(WINDOWS), "--quiet")
    assert code == 0 and "already converted" in out


class _Dequantized:
    """A container's weights as float32 arrays."""

    def __init__(self, engine: Engine):
        self.inner = engine.experts

    def has(self, name: str) -> bool:
        return self.inner.has(name)

    def weight(self, name: str) -> np.ndarray:
        w = self.inner.weight(name)
        return w.dequantize() if isinstance(w, QuantWeight) else w


def _layer_input_hessian(engine: Engine, windows: list[np.ndarray], layer: int) -> np.ndarray:
    """mean u u^T of layer `layer`'s normed input rows u over `windows`, the layers before it run on the
    container's own (quantized) weights, as the converter runs them (dequantized, its backend settings): what
    GPTQ of q_a_proj needs."""
    workers = WORKERS
    model = GlmMoeDsaModel(engine.config, _Dequantized(engine), NumpyBackend(workers=workers))
    total, rows = np.zeros((model.config.hidden_size,) * 2), 0
    with threadpool_limits(1 if workers > 1 else None, user_api="blas"):
        for ids in windows:
            x, chosen = model.embed(ids), None
            cache = model.new_cache()
            for i in range(layer):
                x, chosen = model.decoder_layer(i, x, np.arange(len(ids)), cache.layer(i), chosen)
            norm = model.layers[layer].input_norm
            u = NumpyBackend().rms_norm(x, model.weights.weight(norm.weight), norm.eps)  # type: ignore[arg-type]
            total += u.T.astype(np.float64) @ u
            rows += len(u)
    return (total / rows).astype(np.float32)


@pytest.mark.parametrize("layer", [0, 2])
def test_each_layer_is_gptq_of_the_hessian_of_its_quantized_inputs(calibrated, layer):
    """A layer's q_a_proj in the container = GPTQ from the Hessian of its inputs as the converted layers before it
    (and the converted embedding) compute them, built here by hand from the container."""
    engine = Engine(calibrated, "numpy", load_tokenizer=False)
    windows = [np.asarray(w) for w in json.loads(CALIB.read_text())[:WINDOWS]]
    hessian = _layer_input_hessian(engine, windows, layer)
    name = f"model.layers.{layer}.self_attn.q_a_proj.weight"
    snapshot = HFSnapshot(TRAINED)
    spec = next(s for s in model_tensors(snapshot.config) if s.name == name)
    stored = engine.container.weight(name)
    assert stored.scheme == "nl4"  # q4's default grid: the converted layers run through it as the runtime does
    codes, scales = gptq_quantize(snapshot.load(spec), HessianFactor.from_hessian(hessian), 4, 64,
                                  scheme=stored.scheme)
    assert np.array_equal(stored.scales, scales) and np.array_equal(stored.packed, pack(codes, 4))
    # the Hessian of the inputs the source layers would compute gives other codes: propagation matters
    if layer:
        source = Engine(convert(calibrated.parent / "f32", "--preset", "f32"), "numpy", load_tokenizer=False)
        other, _ = gptq_quantize(snapshot.load(spec), HessianFactor.from_hessian(
            _layer_input_hessian(source, windows, layer)), 4, 64, scheme=stored.scheme)
        assert not np.array_equal(pack(other, 4), stored.packed)


def test_calibrate_windows_bound_and_bad_calibration_files(tmp_path):
    one = Container(convert(tmp_path / "one", "--preset", "q2", "--calibrate", CALIB, "--calibrate-windows", "1"))
    assert one.manifest.conversion["calibration"] == {
        "windows": 1, "tokens": 128, "tokens_sha256": one.manifest.conversion["calibration"]["tokens_sha256"],
        "hessians": "pooled", "propagate": "quantized"}
    text = tmp_path / "sample.py"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + 1\n\n" for i in range(200)))
    from_text = Container(convert(tmp_path / "text", "--preset", "q4", "--calibrate", text, "--calibrate-windows", "1"))
    assert from_text.manifest.conversion["calibration"]["tokens"] > 0
    bad = {"missing.json": None, "short.json": "[[5]]", "vocab.json": "[[1, 99999]]", "notjson.json": "[[1, 2",
           "empty.txt": "", "binary.txt": b"\xff\xfe\x00"}
    for name, content in bad.items():
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
        code, _, err = run(convert_main, TRAINED, tmp_path / "bad", "--calibrate", path, "--quiet")
        assert code == 1 and name in err and err.count("\n") == 1, (name, err)
        assert not (tmp_path / "bad").exists()
    for args, message in ((("--imatrix", tmp_path / "x"), "--calibrate and --imatrix"),
                          (("--calibrate-windows", "0"), "--calibrate-windows"),
                          (("--quantizer", "mse"), "--quantizer gptq")):
        code, _, err = run(convert_main, TRAINED, tmp_path / "bad", "--calibrate", CALIB, *args, "--quiet")
        assert code == 1 and message in err and err.count("\n") == 1, err
    code, out, _ = run(convert_main, TRAINED, tmp_path / "plan", "--calibrate", CALIB, "--dry-run")
    assert code == 0 and "layer by layer" in out and "temporary q8" not in out and not (tmp_path / "plan").exists()
    with pytest.raises(GlmkitError, match="at least 2 tokens"):
        LayerwiseCalibration([[1]])


def test_interrupted_calibrated_conversion_resumes_from_its_data_files(calibrated, tmp_path, monkeypatch, capsys):
    """Killed part way: no container; the same command resumes, replaying the completed layers from the data files
    written (the source's are not read again), and gives the uninterrupted run's tensors."""
    out = tmp_path / "out"
    args = [str(TRAINED), str(out), "--preset", "q4", "--calibrate", str(CALIB), "--calibrate-windows",
            str(WINDOWS), "--max-file-size", "64K", "--quiet"]
    real = fail_reading(monkeypatch, "model.layers.3.")
    assert convert_main(args) == 1
    assert not (out / "manifest.json").exists()
    assert (out / ".glm-convert" / "done.jsonl").read_text().count("\n") >= 2  # data files were complete
    monkeypatch.setattr(HFSnapshot, "load", real)
    fail_reading(monkeypatch, "model.layers.0.")  # completed: replayed from OUT
    capsys.readouterr()
    assert convert_main(args) == 0
    assert "resuming" in capsys.readouterr().err
    digests = {n: e.sha256 for n, e in Container(out).manifest.tensors.items()}
    assert digests == {n: e.sha256 for n, e in Container(calibrated).manifest.tensors.items()}


def test_calibration_through_source_weights_starts_over(tmp_path, monkeypatch, capsys):
    from glmkit.convert.convert import convert as convert_library
    from glmkit.convert.plan import QuantPlan

    windows = json.loads(CALIB.read_text())[:1]

    def run_once() -> None:
        convert_library(TRAINED, tmp_path / "out", QuantPlan.from_preset("q4", quantizer="gptq"), "q4",
                        max_file_bytes=64 << 10, progress=False, calibration=LayerwiseCalibration(windows, "source"))

    real = fail_reading(monkeypatch, "model.layers.3.")
    with pytest.raises(GlmkitError, match="simulated"):
        run_once()
    monkeypatch.setattr(HFSnapshot, "load", real)
    capsys.readouterr()
    run_once()
    assert "starting over" in capsys.readouterr().err
    assert Container(tmp_path / "out").manifest.conversion["calibration"]["propagate"] == "source"


@pytest.mark.parametrize("layout", [{"fp8": True, "shards": 3}, {"fused": True, "mtp": False}])
def test_one_pass_on_fp8_fused_and_mtp_less_sources(tmp_path, layout):
    """FP8 with block scales over several shards, fused expert tensors, no MTP layer: each still calibrates."""
    from tools.synth import TINY_CONFIG, make_snapshot

    config = {**TINY_CONFIG, "num_nextn_predict_layers": 1 if layout.pop("mtp", True) else 0}
    make_snapshot(tmp_path / "src", config, **layout)
    windows = np.random.default_rng(0).integers(0, config["vocab_size"], (2, 24)).tolist()
    (tmp_path / "calib.json").write_text(json.dumps(windows))
    code, _, err = run(convert_main, tmp_path / "src", tmp_path / "out", "--calibrate", tmp_path / "calib.json",
                       "--quiet")
    assert code == 0, err
    container = Container(tmp_path / "out")
    assert container.manifest.conversion["calibration"]["tokens"] == 48
    assert container.manifest.conversion["mtp"] == bool(config["num_nextn_predict_layers"])
    engine = Engine(tmp_path / "out", "numpy", load_tokenizer=False)
    logits, _ = engine.model.forward(np.asarray(windows[0]), engine.model.new_cache())
    assert np.isfinite(logits).all()
