"""The decode step's shadow selection (DESIGN section 3, "DSA indexer"): stage-1 scores from int8 shadows of the
indexer keys, a provable superset of the top-k rescored exactly, the top-k among them. It must choose exactly the keys
the exact path (`index_scores` + `topk_select` over every key) chooses: checked kernel by kernel against it over
random keys, exact ties, all-zero keys, every KV precision, a causal mask of two rows and both fallbacks, then as the
whole decode step, whose logits must be bit for bit the exact path's, also after a prefix restored from the cache."""

from __future__ import annotations

import numpy as np
import pytest

from glmkit.backends.opencl import decode_graph
from glmkit.backends.opencl.backend import OpenCLBackend, Placement
from glmkit.backends.opencl.ops import Kernels
from glmkit.cache.prefix_cache import PrefixCache
from glmkit.generate.engine import Engine
from glmkit.model.glm5 import GlmMoeDsaModel
from glmkit.model.kv_cache import (
    KV_DTYPES,
    SHADOW_BLOCK,
    LayerKV,
    encode_index_shadow,
    shadow_bound,
)
from tests.runtime_support import Snapshots, opencl_test_device


@pytest.fixture(scope="module")
def kernels():
    k = Kernels(opencl_test_device())
    if not (k.direct and k.lanes == 1):
        pytest.skip("the shadow selection runs on CPU OpenCL devices")
    return k


def stored_keys(keys: np.ndarray, kv_dtype: str) -> LayerKV:
    """A layer holding `keys [T, d]` as indexer keys at kv_dtype (their shadows derived by the host)."""
    layer = LayerKV(1, 1, keys.shape[1], dtype=kv_dtype)
    zeros = np.zeros((len(keys), 1), np.float32)
    layer.append(kv_lat=zeros, k_rot=zeros, index_k=keys)
    return layer


def run(kernels: Kernels, name: str, size, local, kv_dtype: str = "f32", **args) -> None:
    kernels.bind(name, size, local, kv_dtype=kv_dtype, **args).enqueue().wait()


def select_both(k: Kernels, q: np.ndarray, layer: LayerKV, w: np.ndarray, allowed: np.ndarray, topk: int,
                max_listed: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the exact path's chosen keys `[S, topk]`, the shadow selection's, the keys it listed per row `[S]`) for
    queries q `[S, nh, d]`, head weights w `[S, nh]` over the layer's keys, row s choosing among allowed[s]."""
    n_s, nh, d = q.shape
    n = layer.length
    scale, w_scale = d ** -0.5, nh ** -0.5
    b = k.buffers
    keys = b.filled(layer.storage("index_k")[:n].view(np.uint8), np.uint8).buffer
    key_scale = b.filled(layer.scales("index_k")[:n] if layer.scales("index_k") is not None else np.ones(n)).buffer
    qa, wa, al = b.filled(q), b.filled(w), b.filled(allowed.astype(np.uint8), np.uint8)
    dtype = layer.dtype
    # the exact path
    exact_scores, selected, exact = b.array(n_s * n), b.array(n_s * n, np.uint8), b.array(n_s * topk, np.uint32)
    exact.host[:] = 0
    run(k, "index_scores", (n, n_s), None, dtype, q=qa.buffer, k=keys, k_scale=key_scale, w=wa.buffer,
        out=exact_scores.buffer, nh=nh, d=d, n_keys=n, scale=scale, w_scale=w_scale)
    run(k, "topk_select", (n_s,), None, scores=exact_scores.buffer, allowed=al.buffer, selected=selected.buffer,
        chosen=exact.buffer, n_keys=n, k=topk, n_rows=n_s)
    # the shadows as the decode step writes them: the host's, bit for bit
    codes, shadow_scale = layer.shadow()
    dev_codes, dev_scale = b.array(codes.size, np.int8), b.array(shadow_scale.size)
    dev_codes.host[:], dev_scale.host[:] = 7, -1.0
    run(k, "index_shadow_rows", (n,), None, dtype, index_k=keys, index_k_scale=key_scale, shadow=dev_codes.buffer,
        shadow_scale=dev_scale.buffer, row=0, d=d)
    blocks = -(-n // SHADOW_BLOCK)
    np.testing.assert_array_equal(dev_codes.host.reshape(codes.shape)[:blocks].reshape(-1, d, SHADOW_BLOCK)
                                  .transpose(0, 2, 1).reshape(-1, d)[:n],
                                  codes[:blocks].transpose(0, 2, 1).reshape(-1, d)[:n])
    np.testing.assert_array_equal(dev_scale.host[:n], shadow_scale[:n])
    # the shadow selection
    upper, listed, count = b.array(n_s * n), b.array(n_s * n, np.uint32), b.array(n_s, np.uint32)
    bounds = {"upper": upper.buffer, "block_lower": b.array(n_s * blocks).buffer,
              "block_upper": b.array(n_s * blocks).buffer}
    chosen, listed_scores = b.array(n_s * topk, np.uint32), b.array(n_s * n)
    chosen.host[:] = 0
    common = {"q": qa.buffer, "w": wa.buffer, "nh": nh, "d": d, "n_keys": n, "w_scale": w_scale}
    run(k, "index_shadow_scores", (blocks, n_s), None, **common, shadow=dev_codes.buffer,
        shadow_scale=dev_scale.buffer, allowed=al.buffer, **bounds, scale=scale, bound=shadow_bound(d, nh) * scale)
    run(k, "index_candidates", (n_s,), None, **bounds, allowed=al.buffer, listed=listed.buffer, count=count.buffer,
        n_keys=n, k=topk, max_listed=n if max_listed is None else max_listed, n_rows=n_s)
    run(k, "index_scores_listed", (64, n_s), None, dtype, **common, k=keys, k_scale=key_scale, listed=listed.buffer,
        count=count.buffer, out=listed_scores.buffer, scale=scale)
    run(k, "topk_listed", (n_s,), None, scores=listed_scores.buffer, listed=listed.buffer, count=count.buffer,
        chosen=chosen.buffer, n_keys=n, k=topk, n_rows=n_s)
    for s in range(n_s):  # the listed keys' exact scores are the exact path's, bit for bit
        got = listed.host[s * n: s * n + count.host[s]]
        np.testing.assert_array_equal(listed_scores.host[s * n: s * n + len(got)], exact_scores.host[s * n + got])
    return (exact.host.reshape(n_s, topk).copy(), chosen.host.reshape(n_s, topk).copy(),
            count.host.astype(np.int64).copy())


def random_case(rng, n_s=2, nh=8, d=32, n=1500):
    q = rng.standard_normal((n_s, nh, d)).astype(np.float32)
    w = rng.standard_normal((n_s, nh)).astype(np.float32)
    return q, w, (rng.standard_normal((n, d)) * rng.uniform(0.1, 3, (n, 1))).astype(np.float32)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_shadow_selection_chooses_the_exact_keys(kernels, kv_dtype):
    rng = np.random.default_rng(11)
    q, w, keys = random_case(rng)
    layer = stored_keys(keys, kv_dtype)
    allowed = np.ones((2, len(keys)), bool)
    allowed[1, -1] = False  # two token rows: the first may not choose the second's key
    exact, chosen, count = select_both(kernels, q, layer, w, allowed, 40)
    np.testing.assert_array_equal(chosen, exact)
    assert (count < len(keys) // 4).all() and (count >= 40).all()  # the bound keeps few keys for stage 2


@pytest.mark.parametrize("nh, d", [(11, 20), (3, 17), (16, 24)])
def test_shadow_selection_heads_in_eights_and_the_rest(kernels, nh, d):
    """Stage 1 takes 8 heads at a time and the rest one by one: head counts and widths that hit each part."""
    rng = np.random.default_rng(nh)
    q, w, keys = random_case(rng, n_s=1, nh=nh, d=d, n=700)
    exact, chosen, count = select_both(kernels, q, stored_keys(keys, "f32"), w, np.ones((1, 700), bool), 20)
    np.testing.assert_array_equal(chosen, exact)
    assert count[0] < 700 // 4


def test_shadow_bounds_per_head_list_few_keys(kernels):
    """Bounding each head's ReLU on its own (a head that is off with room to spare adds no width) keeps stage 2 near
    the top-k: under 2.3 k of 8,192 random keys over four draws, where one width for the whole score listed 2.5-6 k."""
    for seed in range(4):
        rng = np.random.default_rng(seed)
        q, w, keys = random_case(rng, d=64, n=8192)
        exact, chosen, count = select_both(kernels, q, stored_keys(keys, "f32"), w, np.ones((2, 8192), bool), 128)
        np.testing.assert_array_equal(chosen, exact)
        assert (count < 2.3 * 128).all(), count


def test_shadow_selection_ties_zeros_and_fallbacks(kernels):
    rng = np.random.default_rng(5)
    q, w, keys = random_case(rng, n=1203)
    # exact ties: the same key many times over (their scores equal, the lowest indices win), all-zero keys (score
    # 0, or -0 with a negative head weight), keys that differ from a tied one by less than their shadow's step
    keys[100:700:3] = keys[50]
    keys[701:1000:5] = 0
    keys[1001:1100] = keys[60] + rng.standard_normal((99, keys.shape[1])).astype(np.float32) * 1e-4
    w[1, ::2] = -np.abs(w[1, ::2])
    layer = stored_keys(keys, "f32")
    allowed = np.ones((2, len(keys)), bool)
    for topk in (30, 150):
        exact, chosen, count = select_both(kernels, q, layer, w, allowed, topk)
        np.testing.assert_array_equal(chosen, exact)
    # queries that every tied key wins: the ties straddle the k-th place
    q[0] = keys[50] * 3
    exact, chosen, count = select_both(kernels, q, layer, w, allowed, 64)
    np.testing.assert_array_equal(chosen, exact)
    assert len(set(exact[0].tolist()) & set(range(100, 700, 3))) == 64 - 1 or count[0] > 64
    # more listed keys than allowed: every key rescored (today's selection)
    exact, chosen, count = select_both(kernels, q, layer, w, allowed, 30, max_listed=31)
    np.testing.assert_array_equal(chosen, exact)
    assert (count == len(keys)).all()
    # fewer blocks with an allowed key than k: every allowed key rescored
    sparse = rng.random((2, len(keys))) < 0.02
    exact, chosen, count = select_both(kernels, q, layer, w, sparse, 30)
    np.testing.assert_array_equal(chosen, exact)
    assert (count == sparse.sum(1)).all()


def test_host_shadow_bounds_the_stored_keys():
    """encode_index_shadow: |key - scale * code| <= scale * (1/2 + 2^-12), codes within +-127, zero rows 0."""
    rng = np.random.default_rng(2)
    keys = (rng.standard_normal((300, 48)) * np.exp(rng.uniform(-20, 20, (300, 1)))).astype(np.float32)
    keys[7] = 0
    for dtype in KV_DTYPES:
        codes, scales = encode_kv_rows_at(dtype, keys)
        shadow, shadow_scale = encode_index_shadow(codes)
        err = np.abs(codes.astype(np.float64) - shadow_scale[:, None] * shadow.astype(np.float64))
        assert (err <= shadow_scale[:, None] * (0.5 + 2.0 ** -12)).all()
        assert np.abs(shadow).max() == 127 and (shadow[7] == 0).all() and shadow_scale[7] == 0


def encode_kv_rows_at(dtype: str, rows: np.ndarray) -> tuple[np.ndarray, None]:
    """Rows as the kernels read them at `dtype` (rounded and widened back to f32)."""
    layer = stored_keys(rows, dtype)
    return layer.rows("index_k"), None


# ---- the whole decode step -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    return Snapshots(tmp_path_factory)


def device_model(engine: Engine, kernels: Kernels, kv_dtype: str) -> GlmMoeDsaModel:
    backend = OpenCLBackend(kernels, Placement(), model_bytes=engine.container.nbytes)
    return GlmMoeDsaModel(engine.config, engine.experts, backend, kv_dtype=kv_dtype)


@pytest.mark.parametrize("kv_dtype", ["f32", "fp8"])
def test_decode_step_shadow_selection_logits_are_the_exact_paths(snapshots, kernels, monkeypatch, tmp_path,
                                                                  kv_dtype):
    """Decoding past SHADOW_MIN_PER_KEPT x index_topk keys with the shadow selection (SHADOW_MIN_KEYS lowered to 0)
    gives the one-stage selection's logits bit for bit, token by token, also from a prefix restored from the prefill
    cache and where every key is rescored (LISTED_SHARE 1: the fallback)."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    topk = engine.config.index_topk
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, engine.config.vocab_size, decode_graph.SHADOW_MIN_PER_KEPT * topk)
    tokens = rng.integers(0, engine.config.vocab_size, 8)
    model = device_model(engine, kernels, kv_dtype)
    calls = {"shadow": 0}
    original = decode_graph.DeviceDecodeStep._queue_layer

    def counted(step, i, layer, kv, pos, keys, slot, turn):
        calls["shadow"] += step.shadow_selects and layer.shadow is not None and keys >= max(
            decode_graph.SHADOW_MIN_KEYS, decode_graph.SHADOW_MIN_PER_KEPT * topk)
        return original(step, i, layer, kv, pos, keys, slot, turn)

    monkeypatch.setattr(decode_graph.DeviceDecodeStep, "_queue_layer", counted)

    def decode(cache, shadow: bool, share: int = decode_graph.LISTED_SHARE) -> np.ndarray:
        monkeypatch.setattr(decode_graph, "SHADOW_MIN_KEYS", 0)
        monkeypatch.setattr(decode_graph, "LISTED_SHARE", share)
        model._decode_step().shadow_selects = shadow
        return np.concatenate([model.forward(np.array([t]), cache)[0] for t in tokens])

    caches = [model.new_cache() for _ in range(3)]
    for cache in caches:
        model.forward(prompt, cache)
    exact = decode(caches[0], False)
    assert calls["shadow"] == 0
    shadowed = decode(caches[1], True)
    assert calls["shadow"] > 0
    np.testing.assert_array_equal(shadowed, exact)
    np.testing.assert_array_equal(decode(caches[2], True, share=1), exact)
    # a prefix restored from the prefill cache: the shadows are derived from the restored rows
    store = PrefixCache.for_model(model, engine.model_hash, tmp_path, use_mtp=False, chunk_tokens=topk)
    assert store.store(caches[0], prompt.tolist()) > 0
    restored = [model.new_cache() for _ in range(2)]
    for cache in restored:
        done = store.restore(cache, prompt.tolist()).tokens
        assert done >= len(prompt) - topk
        model.forward(prompt[done:], cache)
    np.testing.assert_array_equal(decode(restored[0], True), decode(restored[1], False))
