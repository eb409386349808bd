"""The `mse` scale search (never worse than absmax in weighted squared error) and GPTQ: deterministic, format v1;
over uniform codes and over nl4's table (weight kind "nl4")."""

from __future__ import annotations

import numpy as np
import pytest

from glmkit.convert.plan import QuantPlan
from glmkit.convert.quantizers import (
    HessianFactor,
    choose_scales,
    gptq_quantize,
    normalized_importance,
    search_scales,
    weighted_error,
)
from glmkit.errors import GlmkitError
from glmkit.format.packing import (
    NL4_LEVELS,
    absmax_scales,
    code_values,
    dequantize,
    expand_scales,
    pack,
    quantize,
    scales_shape,
)


def _kind(kind: int | str) -> tuple[int, str]:
    """(bits, quant scheme) of a weight kind: a bit width (uniform codes), or "nl4"."""
    return (4, "nl4") if kind == "nl4" else (int(kind), "symmetric")


def _weights(seed: int, rows: int = 48, cols: int = 200) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[rng.random(w.shape) < 0.01] *= 8  # a few outliers, as trained weights have
    w[3] = 0.0  # an all-zero row
    w[5, :70] = 0.0  # an all-zero group
    return w


@pytest.mark.parametrize("kind,group", [(2, 64), (4, 64), (4, None), (8, None), (4, 32), ("nl4", 64), ("nl4", None),
                                        ("nl4", 32)])
@pytest.mark.parametrize("weighted", [False, True])
def test_search_never_worse_than_absmax_and_deterministic(kind, group, weighted):
    bits, scheme = _kind(kind)
    w = _weights(bits + (group or 0))
    rng = np.random.default_rng(7)
    importance = normalized_importance(rng.gamma(0.5, size=w.shape[1])) if weighted else None
    absmax = absmax_scales(w, bits, group, scheme)
    found = search_scales(w, bits, group, importance, scheme=scheme)
    assert found.shape == absmax.shape == scales_shape(w.shape, group) and found.dtype == np.float32
    # per row: the search decides per row/group, so it never loses anywhere
    for r in range(w.shape[0]):
        sel = slice(r, r + 1)
        assert (weighted_error(w[sel], found[sel], bits, group, importance, scheme)
                <= weighted_error(w[sel], absmax[sel], bits, group, importance, scheme))
    total_found = weighted_error(w, found, bits, group, importance, scheme)
    total_absmax = weighted_error(w, absmax, bits, group, importance, scheme)
    # nl4's absmax is already near its best here (its dense levels near 0 serve the many small weights)
    assert total_found < total_absmax * (0.999 if bits == 8 else 0.98 if scheme == "nl4" else 0.95)
    again = search_scales(w, bits, group, importance, threads=3, scheme=scheme)
    np.testing.assert_array_equal(found, again)  # deterministic, whatever the threading
    assert np.isfinite(found).all()
    if scheme == "nl4":  # all-zero row 3 and group 5:0..63: scale 0, so they dequantize to exact zeros
        assert (found[3] == 0).all() and (group is None or found[5, 0] == 0)
        assert np.array_equal(dequantize(pack(quantize(w, 4, group, found, scheme)[0], 4), found, 4, group,
                                         w.shape[1], scheme)[3], w[3])
    else:
        assert found[3].min() > 0


def test_nl4_beats_uniform_int4_at_the_same_size():
    """On normal-like weights the nl4 table's mse search lowers the plain squared error below uniform int4's (both
    store 4 bits and one scale per group)."""
    w = _weights(9, rows=64, cols=256)
    errors = []
    for scheme in ("symmetric", "nl4"):
        codes, scales = quantize(w, 4, 64, choose_scales(w, 4, 64, "mse", scheme=scheme), scheme)
        errors.append(float(((dequantize(pack(codes, 4), scales, 4, 64, 256, scheme) - w) ** 2).sum()))
    assert errors[1] < 0.85 * errors[0]


def test_importance_moves_accuracy_to_the_important_columns():
    w = _weights(1, cols=128)
    importance = np.ones(128, np.float32)
    importance[:16] = 50.0
    plain = search_scales(w, 2, 64)
    weighted = search_scales(w, 2, 64, normalized_importance(importance))
    assert not np.array_equal(plain, weighted)
    first = slice(0, 16)
    err = [float(((w[:, first] - dequantize(pack(*quantize(w, 2, 64, s)[:1], 2), s, 2, 64, 128)[:, first]) ** 2)
                 .sum()) for s in (plain, weighted)]
    assert err[1] < err[0]


def test_search_result_is_plain_format_v1():
    """Codes are re-derived from the chosen scales: clip(rint(w / s)), packed as always."""
    w = _weights(2)
    s = choose_scales(w, 4, 64, "mse")
    codes, scales = quantize(w, 4, 64, s)
    np.testing.assert_array_equal(scales, s)
    full = np.repeat(s, 64, axis=1)[:, :200]
    np.testing.assert_array_equal(codes, np.clip(np.rint(w / full), -8, 7))
    back = dequantize(pack(codes, 4), scales, 4, 64, 200)
    assert np.abs(back - w).max() < np.abs(w).max()
    np.testing.assert_array_equal(choose_scales(w, 4, 64, "absmax"), absmax_scales(w, 4, 64))
    with pytest.raises(ValueError):
        choose_scales(w, 4, 64, "nope")
    # nl4: each code is the level nearest w / s, whatever the sign of the scale the search kept
    s = choose_scales(w, 4, 64, "mse", scheme="nl4")
    assert (s < 0).any() and (s > 0).any()
    codes = quantize(w, 4, 64, s, "nl4")[0]
    full = np.repeat(s, 64, axis=1)[:, :200]
    scaled = full != 0  # groups of zeros have scale 0: any code stands for 0
    assert (w[~scaled] == 0).all()
    nearest = np.abs((w[scaled] / full[scaled])[..., None] - NL4_LEVELS.astype(np.float64)).argmin(-1) - 8
    assert (codes[scaled] == nearest).mean() > 0.999  # (float ties aside)
    with pytest.raises(ValueError, match="4-bit only"):
        choose_scales(w, 2, 64, "mse", scheme="nl4")


def test_normalized_importance():
    v = normalized_importance(np.array([0.0, 1.0, 3.0]))
    assert v.mean() == pytest.approx(1.0, abs=1e-3) and v[0] > 0 and v[2] == pytest.approx(3 * v[1])
    np.testing.assert_array_equal(normalized_importance(np.zeros(4)), np.ones(4))


def test_plan_records_the_quantizer():
    assert QuantPlan.from_preset("q4").to_json()["quantizer"] == "mse"
    assert QuantPlan.from_preset("q4", quantizer="absmax").to_json()["quantizer"] == "absmax"
    assert QuantPlan.from_preset("q4", quantizer="gptq").to_json()["quantizer"] == "gptq"
    with pytest.raises(GlmkitError, match="--quantizer"):
        QuantPlan.from_preset("q4", quantizer="awq")


def test_imatrix_importance_and_unseen_expert_fallback():
    """An expert the calibration text never reached gets its layer's other experts' mean (by rows seen)."""
    from glmkit.convert.convert import Importance
    from glmkit.format.config import ModelConfig
    from glmkit.format.imatrix import Imatrix
    from glmkit.format.schema import model_tensors
    from tests.runtime_support import FIXTURES

    specs = model_tensors(ModelConfig.from_file(FIXTURES / "tiny-trained" / "config.json"))
    rng = np.random.default_rng(3)

    def name(e: int) -> str:
        return f"model.layers.2.mlp.experts.{e}.down_proj.weight"

    seen = {name(0): rng.random(96).astype(np.float32), name(1): rng.random(96).astype(np.float32)}
    imatrix = Imatrix(seen, {name(0): 10, name(1): 30})
    importance = Importance(imatrix, specs, QuantPlan.from_preset("q4"))
    by_name = {s.name: s for s in specs}
    np.testing.assert_allclose(importance(by_name[name(1)]), normalized_importance(seen[name(1)]))
    expected = normalized_importance((seen[name(0)] * 10.0 + seen[name(1)] * 30.0) / 40)
    np.testing.assert_allclose(importance(by_name[name(7)]), expected, rtol=1e-6)
    assert importance(by_name["model.embed_tokens.weight"]) is None  # a lookup, no linear input: uniform
    assert Importance(None, specs, QuantPlan.from_preset("q4"))(by_name[name(1)]) is None
    with pytest.raises(GlmkitError, match="another model"):
        Importance(Imatrix({name(0): np.ones(64, np.float32)}, {name(0): 1}), specs, QuantPlan.from_preset("q4"))
    with pytest.raises(GlmkitError, match="mse"):
        Importance(imatrix, specs, QuantPlan.from_preset("q4", quantizer="absmax"))
    with pytest.raises(GlmkitError, match="no Hessians"):
        Importance(imatrix, specs, QuantPlan.from_preset("q4", quantizer="gptq"))
    with pytest.raises(GlmkitError, match="--calibrate"):
        Importance(None, specs, QuantPlan.from_preset("q4", quantizer="gptq"))


def _correlated_inputs(seed: int, cols: int, rows: int = 2000) -> np.ndarray:
    """Activations whose columns are strongly correlated (low-rank plus noise, uneven scales), as in LLMs."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 12)) @ rng.standard_normal((12, cols)) + 0.3 * rng.standard_normal((rows, cols))
    return (x * rng.gamma(1.0, size=cols)).astype(np.float32)


def _output_error(w: np.ndarray, codes: np.ndarray, scales: np.ndarray, group: int | None, h: np.ndarray,
                  scheme: str = "symmetric") -> float:
    """Mean squared output error `tr(dW H dW^T)` of a quantization, H = mean x x^T."""
    dw = (w - code_values(codes, scheme) * expand_scales(scales, w.shape[1], group)).astype(np.float64)
    return float(np.einsum("oi,ij,oj->", dw, h, dw))


@pytest.mark.parametrize("kind,group", [(4, 64), (2, 64), (8, None), (4, None), ("nl4", 64), ("nl4", None)])
def test_gptq_cuts_output_error_on_correlated_inputs(kind, group):
    bits, scheme = _kind(kind)
    w = _weights(bits, rows=40, cols=150)
    x = _correlated_inputs(bits, 150)
    h = x.T.astype(np.float64) @ x / len(x)
    codes, scales = gptq_quantize(w, HessianFactor.from_hessian(h), bits, group, scheme=scheme)
    assert codes.dtype == np.int8 and scales.dtype == np.float32 and scales.shape == scales_shape(w.shape, group)
    top = (1 << (bits - 1)) - 1
    assert codes.min() >= -top - 1 and codes.max() <= top
    rtn = quantize(w, bits, group, search_scales(w, bits, group, normalized_importance(np.diag(h)), scheme=scheme),
                   scheme)
    assert _output_error(w, codes, scales, group, h, scheme) < 0.7 * _output_error(w, *rtn, group, h, scheme)
    again = gptq_quantize(w, HessianFactor.from_hessian(h), bits, group, threads=3, scheme=scheme)
    np.testing.assert_array_equal(codes, again[0])  # deterministic, whatever the threading
    np.testing.assert_array_equal(scales, again[1])
    back = dequantize(pack(codes, bits), scales, bits, group, w.shape[1], scheme)  # plain format v1
    np.testing.assert_allclose(back, code_values(codes, scheme) * expand_scales(scales, w.shape[1], group), rtol=1e-6)


@pytest.mark.parametrize("scheme", ["symmetric", "nl4"])
def test_gptq_with_uncorrelated_inputs_is_the_weighted_search(scheme):
    """A diagonal H carries no error across columns: GPTQ's codes are then exactly the mse search's."""
    w = _weights(5, cols=128)  # whole groups: a partial last group's search sums in another order (1 ulp)
    diag = np.random.default_rng(5).gamma(0.7, size=128)
    codes, scales = gptq_quantize(w, HessianFactor.from_hessian(np.diag(diag)), 4, 64, scheme=scheme)
    expected = quantize(w, 4, 64, search_scales(w, 4, 64, normalized_importance(diag), scheme=scheme), scheme)
    np.testing.assert_array_equal(scales, expected[1])
    np.testing.assert_array_equal(codes, expected[0])


def test_gptq_dead_columns_and_bad_hessians():
    w = _weights(6, cols=100)
    x = _correlated_inputs(6, 100)
    x[:, 10:20] = 0.0  # columns calibration never reached
    codes, scales = gptq_quantize(w, HessianFactor.from_hessian(x.T @ x / len(x)), 4, 64)
    assert np.isfinite(scales).all() and (scales > 0).all()
    rounded = quantize(w, 4, 64, scales)[0]
    np.testing.assert_array_equal(codes[:, 0], rounded[:, 0])  # nothing to correct before the first column
    np.testing.assert_array_equal(codes[:, 10:20], rounded[:, 10:20])  # dead columns take and pass no error
    with pytest.raises(ValueError, match="shape"):
        gptq_quantize(w, HessianFactor.from_hessian(np.eye(99)), 4, 64)
    with pytest.raises(ValueError, match="square"):
        HessianFactor.from_hessian(np.ones((4, 5)))
    bad = np.eye(100)
    bad[3, 4] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        HessianFactor.from_hessian(bad)
