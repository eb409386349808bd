"""The `mse` scale search: never worse than absmax in weighted squared error, deterministic, format v1."""

from __future__ import annotations

import numpy as np
import pytest

from glmkit.convert.plan import QuantPlan
from glmkit.convert.quantizers import choose_scales, normalized_importance, search_scales, weighted_error
from glmkit.errors import GlmkitError
from glmkit.formats.packing import absmax_scales, dequantize, pack, quantize, scales_shape


def _weights(seed: int, rows: int = 48, cols: int = 200) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[rng.random(w.shape) < 0.01] *= 8  # a few outliers, as trained weights have
    w[3] = 0.0  # an all-zero row
    w[5, :70] = 0.0  # an all-zero group
    return w


@pytest.mark.parametrize("bits,group", [(2, 64), (4, 64), (4, None), (8, None), (4, 32)])
@pytest.mark.parametrize("weighted", [False, True])
def test_search_never_worse_than_absmax_and_deterministic(bits, group, weighted):
    w = _weights(bits + (group or 0))
    rng = np.random.default_rng(7)
    importance = normalized_importance(rng.gamma(0.5, size=w.shape[1])) if weighted else None
    absmax = absmax_scales(w, bits, group)
    found = search_scales(w, bits, group, importance)
    assert found.shape == absmax.shape == scales_shape(w.shape, group) and found.dtype == np.float32
    # per row: the search decides per row/group, so it never loses anywhere
    for r in range(w.shape[0]):
        sel = slice(r, r + 1)
        assert (weighted_error(w[sel], found[sel], bits, group, importance)
                <= weighted_error(w[sel], absmax[sel], bits, group, importance))
    total_found = weighted_error(w, found, bits, group, importance)
    total_absmax = weighted_error(w, absmax, bits, group, importance)
    assert total_found < total_absmax * (0.999 if bits == 8 else 0.95)
    again = search_scales(w, bits, group, importance, threads=3)
    np.testing.assert_array_equal(found, again)  # deterministic, whatever the threading
    assert found[3].min() > 0 and np.isfinite(found).all()


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


def test_normalized_importance():
    v = normalized_importance(np.array([0.0, 1.0, 3.0]))
    assert v.mean() == pytest.approx(1.0, abs=1e-3) and v[0] > 0 and v[2] == pytest.approx(3 * v[1])
    np.testing.assert_array_equal(normalized_importance(np.zeros(4)), np.ones(4))


def test_plan_records_the_quantizer():
    assert QuantPlan.from_preset("q4").to_json()["quantizer"] == "mse"
    assert QuantPlan.from_preset("q4", quantizer="absmax").to_json()["quantizer"] == "absmax"
    with pytest.raises(GlmkitError, match="--quantizer"):
        QuantPlan.from_preset("q4", quantizer="gptq")


def test_imatrix_importance_and_unseen_expert_fallback():
    """An expert the calibration text never reached gets its layer's other experts' mean (by rows seen)."""
    from glmkit.convert.convert import Importance
    from glmkit.formats.config import ModelConfig
    from glmkit.formats.imatrix import Imatrix
    from glmkit.formats.schema import model_tensors
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
