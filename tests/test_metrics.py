"""Perplexity / KL-divergence math on hand-checkable cases, and the saved-logits (base) file format."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from glmkit.errors import GlmkitError
from glmkit.eval.logits_file import LogitsBase, LogitsWriter
from glmkit.eval.metrics import (
    QualityAccumulator,
    kl_divergence,
    log_softmax,
    perplexity,
    token_nll,
    top1_matches,
)


def test_log_softmax_is_normalized_and_stable():
    lp = log_softmax(np.array([[0.0, 0.0], [1000.0, 1000.0 + math.log(3)]]))
    np.testing.assert_allclose(lp[0], [math.log(0.5)] * 2)
    np.testing.assert_allclose(lp[1], [math.log(0.25), math.log(0.75)])


def test_uniform_model_has_perplexity_equal_to_vocabulary():
    lp = log_softmax(np.zeros((5, 7)))
    nll = token_nll(lp, np.array([0, 1, 2, 3, 6]))
    np.testing.assert_allclose(nll, math.log(7))
    assert perplexity(nll) == pytest.approx(7.0)


def test_perplexity_is_exp_of_mean_nll():
    lp = np.log(np.array([[0.5, 0.5], [0.25, 0.75]]))
    nll = token_nll(lp, np.array([0, 1]))
    assert perplexity(nll) == pytest.approx(math.exp((math.log(2) + math.log(4 / 3)) / 2))
    assert perplexity(nll) == pytest.approx(math.sqrt(2 * 4 / 3))  # geometric mean of 1/p


def test_kl_divergence_hand_values():
    with np.errstate(divide="ignore"):
        p = np.log(np.array([[0.5, 0.5], [1.0, 0.0], [0.25, 0.75]]))  # log 0 = -inf
    q = np.log(np.array([[0.25, 0.75], [0.5, 0.5], [0.25, 0.75]]))
    kl = kl_divergence(p, q)
    expected = [0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75), math.log(2), 0.0]
    np.testing.assert_allclose(kl, expected, atol=1e-12)
    assert (kl >= 0).all()
    assert kl_divergence(q, q).tolist() == [0.0, 0.0, 0.0]


def test_top1_and_accumulator_summary():
    base = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.2, 0.3, 0.5], [0.4, 0.4, 0.2]]))
    test = np.log(np.array([[0.6, 0.3, 0.1], [0.5, 0.3, 0.2], [0.2, 0.3, 0.5], [0.3, 0.5, 0.2]]))
    assert top1_matches(base, test).tolist() == [True, False, True, False]  # ties -> first index (row 3: 0)
    targets = np.array([0, 1, 2, 1])
    acc = QualityAccumulator()
    acc.add(test[:2], targets[:2], base[:2])
    acc.add(test[2:], targets[2:], base[2:])
    s = acc.summary()
    assert s["tokens"] == 4 and s["top1_agreement"] == 0.5 and s["top1_se"] == pytest.approx(0.25)  # sqrt(.25 / 4)
    ppl = math.exp(-np.mean([math.log(p) for p in (0.6, 0.3, 0.5, 0.5)]))
    base_ppl = math.exp(-np.mean([math.log(p) for p in (0.7, 0.6, 0.5, 0.4)]))
    assert s["ppl"] == pytest.approx(ppl) and s["ppl_ratio"] == pytest.approx(ppl / base_ppl)
    kld = kl_divergence(base, test)
    assert s["kld_mean"] == pytest.approx(kld.mean())
    assert s["kld_p99"] == pytest.approx(np.quantile(kld, 0.99)) and kld.max() >= s["kld_p99"] >= kld.mean()
    plain = QualityAccumulator()
    plain.add(test, targets)
    assert set(plain.summary()) == {"tokens", "ppl"}


def test_logits_file_round_trip_and_refusals(tmp_path):
    windows = [[1, 2, 3, 4], [5, 6, 7]]
    rng = np.random.default_rng(0)
    rows = [log_softmax(rng.standard_normal((3, 10))).astype(np.float32),
            log_softmax(rng.standard_normal((2, 10))).astype(np.float32)]
    path = tmp_path / "base.safetensors"
    w = LogitsWriter(path, "ab" * 32, windows, 10)
    for r in rows:
        w.append(r)
    w.close()
    base = LogitsBase(path)
    assert base.model_hash == "ab" * 32 and base.windows == windows
    np.testing.assert_array_equal(base.rows(1), rows[1])
    base.check_matches(windows, 10)
    with pytest.raises(GlmkitError, match="other tokens"):
        base.check_matches([[1, 2, 3, 4], [5, 6, 8]], 10)
    with pytest.raises(GlmkitError, match="other tokens"):
        base.check_matches(windows[:1], 10)
    with pytest.raises(GlmkitError, match="vocabulary"):
        base.check_matches(windows, 11)

    # the stock safetensors library reads it
    from safetensors.numpy import load_file
    stock = load_file(str(path))
    np.testing.assert_array_equal(stock["tokens"], [1, 2, 3, 4, 5, 6, 7])

    data = bytearray(path.read_bytes())
    data[-40] ^= 1  # a logprob byte (the token tensors sit at the very end)
    (tmp_path / "bad.safetensors").write_bytes(bytes(data))
    with pytest.raises(GlmkitError, match="digest"):
        LogitsBase(tmp_path / "bad.safetensors")
    (tmp_path / "short.safetensors").write_bytes(path.read_bytes()[:-5])
    with pytest.raises(GlmkitError):
        LogitsBase(tmp_path / "short.safetensors")
    (tmp_path / "other.json").write_text(json.dumps([1, 2]))
    with pytest.raises(GlmkitError):
        LogitsBase(tmp_path / "other.json")


def test_logits_writer_leaves_nothing_when_aborted(tmp_path):
    w = LogitsWriter(tmp_path / "b.safetensors", "00" * 32, [[1, 2, 3]], 4)
    w.append(np.zeros((1, 4), np.float32))
    with pytest.raises(GlmkitError):
        w.close()  # one of two rows missing
    assert list(tmp_path.iterdir()) == []


def test_logits_writer_onto_a_directory_made_since_is_an_error_leaving_nothing(tmp_path):
    path = tmp_path / "b.safetensors"
    w = LogitsWriter(path, "00" * 32, [[1, 2]], 4)
    w.append(np.zeros((1, 4), np.float32))
    path.mkdir()
    with pytest.raises(GlmkitError, match=f"{path}: cannot write"):
        w.close()
    assert list(tmp_path.iterdir()) == [path]


def test_logits_writer_never_writes_through_a_file_planted_at_a_temporary_name(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    path = tmp_path / "b.safetensors"
    path.with_name(path.name + ".tmp").symlink_to(victim)
    w = LogitsWriter(path, "00" * 32, [[1, 2]], 4)
    w.append(np.zeros((1, 4), np.float32))
    w.close()
    assert victim.read_bytes() == b"keep" and LogitsBase(path).windows == [[1, 2]]
