"""Unit tests of the forward-pass math (NumPy only; the transformers comparison is
tools/check_model_vs_transformers.py)."""

from __future__ import annotations

import numpy as np
import pytest

from glmkit.backends.numpy_backend import NumpyBackend
from glmkit.format.config import ModelConfig
from glmkit.format.packing import pack, quantize
from glmkit.format.tensors import QuantWeight, Weight
from glmkit.model.glm5 import GlmMoeDsaModel, mla_attend_absorbed, mla_attend_full
from glmkit.model.kv_cache import (
    F16_ROW_MAX,
    INITIAL_ROWS,
    KVCache,
    decode_kv_rows,
    encode_kv_rows,
    kv_bytes_per_token,
)
from glmkit.model.ops import (
    apply_rope,
    chosen_keys,
    embed_rows,
    moe_batch_union,
    position_mask,
    renormalized,
    rope_cos_sin,
    route_noaux_tc,
    silu,
    topk_mask,
)


def causal_mask(start: int, seq: int, total: int) -> np.ndarray:
    """`[S, T]` bool: query at position start+s may see keys 0..start+s."""
    return position_mask(start + np.arange(seq), total)


def quant(w: np.ndarray, bits: int, group: int | None) -> QuantWeight:
    codes, scales = quantize(w, bits, group)
    return QuantWeight(pack(codes, bits), scales, bits, group, w.shape)


def rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


# ---- rope --------------------------------------------------------------------------------------

def test_rope_rotates_each_interleaved_pair_by_pos_times_inv_freq() -> None:
    dim, theta, pos = 8, 10000.0, 5
    cos, sin = rope_cos_sin(np.array([pos]), dim, theta)
    for pair in range(dim // 2):
        x = np.zeros((1, dim), np.float32)
        x[0, 2 * pair] = 1.0  # (e, o) = (1, 0): output (cos a, sin a), de-interleaved
        out = apply_rope(x, cos, sin)[0]
        angle = pos * theta ** (-2 * pair / dim)
        expected = np.zeros(dim)
        expected[pair], expected[dim // 2 + pair] = np.cos(angle), np.sin(angle)
        np.testing.assert_allclose(out, expected, atol=1e-6)


def test_rope_preserves_norms_and_scores_depend_on_relative_position() -> None:
    rng = np.random.default_rng(0)
    q, k = rand(rng, 1, 3, 16), rand(rng, 1, 16)
    rot = [apply_rope(q, *rope_cos_sin(np.array([p]), 16, 500.0)) for p in (3, 10)]
    rot_k = [apply_rope(k, *rope_cos_sin(np.array([p]), 16, 500.0)) for p in (0, 7)]
    np.testing.assert_allclose(np.linalg.norm(rot[0], axis=-1), np.linalg.norm(q, axis=-1), rtol=1e-6)
    # positions (3, 0) and (10, 7) are both 3 apart: identical scores
    np.testing.assert_allclose(rot[0][0] @ rot_k[0][0], rot[1][0] @ rot_k[1][0], rtol=1e-5)


# ---- DSA selection -----------------------------------------------------------------------------

def test_topk_mask_keeps_min_k_t_plus_1_best_causal_keys() -> None:
    scores = np.array([[5, 9, 9, 9], [1, 3, 9, 9], [4, 1, 2, 9], [0, 3, 1, 2]], np.float32)
    causal = causal_mask(0, 4, 4)
    selected = topk_mask(scores, causal, 2)
    expected = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]]
    np.testing.assert_array_equal(selected, np.array(expected, bool))
    np.testing.assert_array_equal(topk_mask(scores, causal, 4), causal)  # k >= T: dense causal


def test_topk_mask_is_the_per_row_stable_sort() -> None:
    """Against the definition, row by row (a stable sort of the allowed scores, the first k): prefill-sized causal
    masks with a cached prefix (row blocks partitioned over their own widths), arbitrary masks, rows with fewer
    than k allowed keys and exact ties."""
    rng = np.random.default_rng(0)
    for seq, total, k, kind in ((300, 300, 40, "causal"), (300, 300, 150, "causal"), (257, 400, 64, "causal"),
                                (200, 150, 30, "random"), (130, 500, 200, "causal")):  # 150: a block as wide as k
        allowed = causal_mask(total - seq, seq, total) if kind == "causal" else rng.random((seq, total)) < 0.4
        for scores in (rng.standard_normal((seq, total)), np.round(rng.standard_normal((seq, total))),
                       rng.integers(0, 3, (seq, total))):  # few distinct values: ties across the k-th score
            scores = scores.astype(np.float32)
            want = np.zeros_like(allowed)
            for row in range(seq):
                keys = np.flatnonzero(allowed[row])
                want[row, keys[np.argsort(-scores[row, keys], kind="stable")[:k]]] = True
            np.testing.assert_array_equal(topk_mask(scores, allowed, k), want)


def test_topk_mask_ties_go_to_the_lowest_keys() -> None:
    """Indexer scores tie exactly (0 when every head's ReLU is off): the lowest key indices win, as in the
    OpenCL kernel, so that every backend attends to the same keys."""
    scores = np.array([[0, 3, 0, 0, 0, 2], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, -1, 1]], np.float32)
    causal = np.ones((3, 6), bool)
    causal[2, 5] = False
    selected = topk_mask(scores, causal, 3)
    expected = [[1, 1, 0, 0, 0, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0]]
    np.testing.assert_array_equal(selected, np.array(expected, bool))


def test_position_mask_with_offset() -> None:
    np.testing.assert_array_equal(causal_mask(2, 2, 4), [[1, 1, 1, 0], [1, 1, 1, 1]])


# ---- router ------------------------------------------------------------------------------------

def test_router_follows_group_rule_and_returns_unbiased_weights() -> None:
    # 8 experts in 4 groups of 2; keep 2 groups, pick 2 experts.
    probs = np.array([[0.95, 0.05, 0.6, 0.6, 0.7, 0.6, 0.1, 0.1]], np.float32)
    logits = np.log(probs / (1 - probs))
    bias = np.zeros(8, np.float32)
    bias[6] = 0.9  # expert 6 is the best biased choice, but group 3's top-2 sum (1.1) still loses
    ids, weights = route_noaux_tc(logits, bias, top_k=2, n_group=4, topk_group=2, norm_topk_prob=True,
                                  scaling=2.5)
    # group sums: g0 1.0, g1 1.2, g2 1.3, g3 1.1 -> groups 1 and 2; best experts there: 4 (0.7), then 2 or 3
    order = np.argsort(ids[0])
    assert ids[0][order][-1] == 4 and ids[0][order][0] in (2, 3)
    expected = np.array([0.6, 0.7]) / 1.3 * 2.5  # sigmoid scores without the bias, normalized, scaled
    np.testing.assert_allclose(weights[0][order], expected, rtol=1e-5)

    bias[7] = 0.9  # now g3 sums to 2.0 and wins; its two experts take both slots
    ids, weights = route_noaux_tc(logits, bias, 2, 4, 2, norm_topk_prob=False, scaling=1.0)
    assert sorted(ids[0]) == [6, 7]
    np.testing.assert_allclose(weights[0], [0.1, 0.1], rtol=1e-5)


def test_moe_batch_union_equals_per_token_loop_and_calls_each_expert_once() -> None:
    rng = np.random.default_rng(1)
    x = rand(rng, 6, 8)
    ids = np.array([[0, 3], [3, 1], [2, 0], [3, 2], [1, 0], [2, 3]])
    weights = rand(rng, 6, 2)
    mats = [rand(rng, 8, 8) for _ in range(4)]
    calls: list[int] = []

    def run(e: int, rows: np.ndarray) -> np.ndarray:
        calls.append(e)
        return np.tanh(rows @ mats[e])

    out = moe_batch_union(x, ids, weights, run)
    loop = np.stack([sum(weights[s, k] * np.tanh(x[s] @ mats[ids[s, k]]) for k in range(2)) for s in range(6)])
    np.testing.assert_allclose(out, loop, rtol=1e-5, atol=1e-6)
    assert sorted(calls) == [0, 1, 2, 3]


# ---- backend -----------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("group", [None, 16, 7])
@pytest.mark.parametrize("rows", [1, 7])
def test_quantized_linear_matches_dequantize_then_matmul(bits: int, group: int | None, rows: int) -> None:
    rng = np.random.default_rng(bits * 100 + rows)
    w = quant(rand(rng, 29, 53), bits, group)  # odd in-features: partial bytes and a partial last group
    x = rand(rng, rows, 53)
    expected = x @ w.dequantize().T
    # Tiny blocks force the blockwise loop over many row blocks on both paths.
    for backend in (NumpyBackend(), NumpyBackend(decode_block=100, prefill_block=300)):
        np.testing.assert_allclose(backend.linear(x, w), expected, rtol=1e-5, atol=1e-5)


def test_head_matmul_matches_dense_per_head_products() -> None:
    rng = np.random.default_rng(2)
    heads, stride, width = 3, 10, 12
    dense = rand(rng, heads * stride, width)
    x, y = rand(rng, 2, heads, width), rand(rng, 2, heads, 6)
    for w in (dense, quant(dense, 4, 4)):
        full = w if isinstance(w, np.ndarray) else w.dequantize()
        b = full.reshape(heads, stride, width)[:, 4:10]  # rows 4..9 of each head
        backend = NumpyBackend()
        np.testing.assert_allclose(backend.head_matmul(x, w, 4, 6, transpose=False),
                                   np.einsum("shi,hri->shr", x, b), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(backend.head_matmul(y, w, 4, 6, transpose=True),
                                   np.einsum("shr,hri->shi", y, b), rtol=1e-5, atol=1e-5)


def test_norms_on_hand_values() -> None:
    backend = NumpyBackend()
    x = np.array([[3.0, 4.0]], np.float32)
    np.testing.assert_allclose(backend.rms_norm(x, np.array([1.0, 2.0], np.float32), 0.0),
                               [[3 / np.sqrt(12.5), 8 / np.sqrt(12.5)]], rtol=1e-6)
    np.testing.assert_allclose(backend.layer_norm(x, np.array([1.0, 2.0], np.float32),
                                                  np.array([0.5, 0.0], np.float32), 0.0), [[-0.5, 2.0]], rtol=1e-6)


def test_attention_shared_key_head_equals_repeated_heads() -> None:
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, 3, 4, 8), rand(rng, 5, 1, 8), rand(rng, 5, 1, 6)
    allowed = causal_mask(2, 3, 5)
    backend = NumpyBackend()
    shared = backend.attention(q, k, v, allowed, 0.3)
    repeated = backend.attention(q, np.repeat(k, 4, axis=1), np.repeat(v, 4, axis=1), allowed, 0.3)
    np.testing.assert_allclose(shared, repeated, rtol=1e-5, atol=1e-6)
    # query 0 (position 2) sees keys 0..2 only
    scores = q[0] @ k[:3, 0].T * 0.3
    probs = np.exp(scores - scores.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    np.testing.assert_allclose(shared[0], probs @ v[:3, 0], rtol=1e-5, atol=1e-6)


def test_index_topk_keeps_the_largest_weighted_relu_sums() -> None:
    """DSA's index score `sum_h w[s,h] relu(scale q[s,h] . k[t])`: index_topk keeps the k largest causal ones, as
    ascending key indices."""
    rng = np.random.default_rng(4)
    q, k, w = rand(rng, 6, 3, 4), rand(rng, 40, 4), rand(rng, 6, 3)
    expected = np.einsum("sh,sht->st", w, np.maximum(np.einsum("shd,td->sht", q, k) * 0.5, 0))
    positions = np.arange(34, 40)
    chosen = NumpyBackend().index_topk(q, k, w, 0.5, positions, 5)
    assert chosen.shape == (6, 5) and (np.diff(chosen, axis=1) > 0).all() and (chosen <= positions[:, None]).all()
    for row in range(6):  # every kept key scores at least as high as every dropped causal key
        dropped = np.setdiff1d(np.arange(positions[row] + 1), chosen[row])
        assert expected[row][chosen[row]].min() >= expected[row][dropped].max()


def test_chosen_keys_lists_each_rows_keys_ascending_padded() -> None:
    selected = np.array([[0, 1, 0, 1, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], bool)
    assert chosen_keys(selected, 3).tolist() == [[1, 3, 4], [0, -1, -1], [-1, -1, -1]]


@pytest.mark.parametrize("kh", [1, 4])
def test_attention_chosen_is_attention_with_the_chosen_keys_mask(kh: int) -> None:
    """Each query over its own gathered keys = masked attention with the mask of those keys (f32 rounding), for one
    shared key head and per-head keys, whole or in column parts, in blocks of queries and on the worker pool; rows of
    fewer keys (-1 padded) included."""
    rng = np.random.default_rng(21)
    seq, heads, total, width = 19, 4, 60, 7
    q, k, v = rand(rng, seq, heads, 6), rand(rng, total, kh, 6), rand(rng, total, kh, 5)
    positions = np.arange(total - seq, total)
    positions[:3] = [2, 4, 5]  # fewer causal keys than `width`
    scores = rand(rng, seq, total)
    selected = topk_mask(scores, causal_mask(0, total, total)[positions], width)
    chosen = chosen_keys(selected, width)
    assert (chosen[:3] == -1).any() and (chosen[3:] >= 0).all()
    expected = reference_attention(q, k, v, selected, 0.3)
    for backend in (NumpyBackend(), NumpyBackend(query_block=width * 30, workers=3)):
        np.testing.assert_allclose(backend.attention_chosen(q, (k,), v, chosen, 0.3), expected, rtol=1e-5, atol=1e-6)
        # the keys in column parts (MLA's latent and rope parts): joined per gathered row
        got = backend.attention_chosen(q, (k[..., :4], k[..., 4:]), v, chosen, 0.3)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_expert_mlp_is_down_of_silu_gate_times_up() -> None:
    rng = np.random.default_rng(5)
    x, g, u, d = rand(rng, 2, 6), rand(rng, 4, 6), rand(rng, 4, 6), rand(rng, 6, 4)
    expected = (silu(x @ g.T) * (x @ u.T)) @ d.T
    np.testing.assert_allclose(NumpyBackend().expert_mlp(x, g, u, d), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(silu(np.array([-200.0, 0.0, 1.0], np.float32)),
                               [0.0, 0.0, 1 / (1 + np.exp(-1))], rtol=1e-6)


# ---- MLA ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("quantized", [False, True])
def test_absorbed_mla_equals_full_reconstruction(quantized: bool) -> None:
    rng = np.random.default_rng(6)
    heads, nope, rope, v_dim, kvl, seq, total = 4, 16, 8, 12, 32, 3, 9
    kv_b: Weight = rand(rng, heads * (nope + v_dim), kvl) * 0.3
    if quantized:
        kv_b = quant(kv_b, 4, 8)
    q_nope, q_rot = rand(rng, seq, heads, nope), rand(rng, seq, heads, rope)
    kv_lat, k_rot = rand(rng, total, kvl), rand(rng, total, rope)
    allowed = causal_mask(total - seq, seq, total)
    allowed[2, 3] = False  # a sparse selection hole
    backend = NumpyBackend()
    full = mla_attend_full(backend, q_nope, q_rot, kv_lat, k_rot, kv_b, allowed, 0.2)
    absorbed = mla_attend_absorbed(backend, q_nope, q_rot, kv_lat, k_rot, kv_b, allowed, 0.2)
    assert full.shape == (seq, heads, v_dim)
    np.testing.assert_allclose(absorbed, full, rtol=1e-4, atol=1e-5)


# ---- KV cache ----------------------------------------------------------------------------------

def tiny_config(**overrides: object) -> ModelConfig:
    raw = dict(model_type="glm_moe_dsa", vocab_size=64, hidden_size=32, num_hidden_layers=3,
               num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
               v_head_dim=8, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
               num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
               routed_scaling_factor=2.5, index_topk=4, index_n_heads=2, index_head_dim=8,
               indexer_types=["full", "shared", "full"], num_nextn_predict_layers=1, rms_norm_eps=1e-5)
    return ModelConfig.from_dict(raw | overrides)


def test_kv_cache_grows_truncates_and_appends_again() -> None:
    config = tiny_config()
    rng = np.random.default_rng(7)
    cache = KVCache(config)
    assert [layer.has_index for layer in cache.layers] == [True, False, True, True]
    rows = {}
    for _ in range(300):  # past the initial capacity
        for i, layer in enumerate(cache.layers):
            fields = {"kv_lat": rand(rng, 1, 16), "k_rot": rand(rng, 1, 4)}
            if layer.has_index:
                fields["index_k"] = rand(rng, 1, 8)
            layer.append(**fields)
            for name, value in fields.items():
                rows.setdefault((i, name), []).append(value)
    assert cache.length == 300
    full = {key: np.concatenate(parts) for key, parts in rows.items()}
    assert {i for i, _ in full} == set(range(len(cache.layers)))
    for (i, name), value in full.items():
        np.testing.assert_array_equal(cache.layer(i).rows(name), value)

    cache.truncate(120)
    assert cache.length == 120 and all(layer.length == 120 for layer in cache.layers)
    for (i, name), value in full.items():
        np.testing.assert_array_equal(cache.layer(i).rows(name), value[:120])
    for i, layer in enumerate(cache.layers):  # appended again after the cut, the rows line up with the originals
        layer.append(**{name: value[120:] for (j, name), value in full.items() if j == i})
    for (i, name), value in full.items():
        np.testing.assert_array_equal(cache.layer(i).rows(name), value)


@pytest.mark.parametrize("dtype", ["f32", "fp8"])
def test_kv_cache_fits_its_arrays_to_a_shorter_sequence(dtype) -> None:
    """`fit`: arrays that hold room for more than twice the rows asked (and than INITIAL_ROWS and the rows kept)
    are remade that size, every kept row, scale and indexer-key shadow bit for bit; smaller ones stay."""
    config = tiny_config()
    rng = np.random.default_rng(11)
    cache = KVCache(config, dtype=dtype)
    layer = cache.layer(0)
    layer.append(kv_lat=rand(rng, 1500, 16), k_rot=rand(rng, 1500, 4), index_k=rand(rng, 1500, 8))
    cache.truncate(300)
    before = {name: np.array(layer.storage(name)[:300]) for name in ("kv_lat", "k_rot", "index_k")}
    scales = None if dtype == "f32" else np.array(layer.scales("kv_lat")[:300])
    codes, shadow_scales = (np.array(a) for a in layer.shadow())
    cache.fit(1000)
    assert layer.storage("kv_lat").shape[0] >= 1500  # not twice 1,000
    cache.fit(400)
    assert cache.capacity == 400 and all(len(kv.storage("k_rot")) <= 400 for kv in cache.layers)
    for name, value in before.items():
        np.testing.assert_array_equal(layer.storage(name)[:300].view(np.uint8), value.view(np.uint8))
    if scales is not None:
        np.testing.assert_array_equal(layer.scales("kv_lat")[:300], scales)
    np.testing.assert_array_equal(layer.shadow()[0][:300 // 8 + 1], codes[:300 // 8 + 1])
    np.testing.assert_array_equal(layer.shadow()[1][:300], shadow_scales[:300])
    cache.fit(10)
    assert cache.capacity == 400  # 300 rows kept: not more than twice them
    layer.append(kv_lat=rand(rng, 900, 16), k_rot=rand(rng, 900, 4), index_k=rand(rng, 900, 8))
    cache.truncate(0)
    cache.fit(10)
    assert cache.capacity == INITIAL_ROWS


@pytest.mark.parametrize("dtype", ["bf16", "f16", "fp8"])
def test_kv_cache_at_lower_precision(dtype) -> None:
    """Rows stored at bf16 / f16 / fp8 read back as their rounding (`encode_kv_rows` then `decode_kv_rows`: bf16 to
    2^-8 of each value, f16 to 2^-11 (and 2^-25 below its normal range), fp8 to 2^-4 of the row's largest),
    through growth, truncation, overwrites, one device-written row (`put_row`) and a copy of the stored codes
    (`encoded` into `append_encoded`: bit for bit)."""
    config = tiny_config()
    rng = np.random.default_rng(9)
    cache = KVCache(config, dtype=dtype)
    layer = cache.layer(0)
    rows = {"kv_lat": rand(rng, 300, 16) * 100, "k_rot": rand(rng, 300, 4), "index_k": rand(rng, 300, 8) * 1e-3}
    rows["kv_lat"][7] = 0.0  # a zero row (fp8: scale 1)
    for start in range(0, 300, 50):
        layer.append(**{name: value[start:start + 50] for name, value in rows.items()})
    assert layer.storage("kv_lat").dtype.itemsize == (1 if dtype == "fp8" else 2)
    assert (layer.scales("kv_lat") is None) == (dtype == "bf16")
    bound = {"bf16": lambda x: 2 ** -8 * np.abs(x), "fp8": lambda x: 2 ** -4 * np.abs(x).max(-1, keepdims=True),
             "f16": lambda x: 2 ** -11 * np.abs(x) + 2 ** -25}  # f16's subnormal step: 2^-24
    for name, value in rows.items():
        got = layer.rows(name)
        assert got.dtype == np.float32 and got.shape == value.shape
        np.testing.assert_array_equal(got, decode_kv_rows(*encode_kv_rows(dtype, value)))
        assert (np.abs(got - value) <= bound[dtype](value)).all() and not np.array_equal(got, value)
        np.testing.assert_array_equal(layer.gather(name, np.array([[3, 250], [7, 0]])), got[[[3, 250], [7, 0]]])
        np.testing.assert_array_equal(layer.rows(name, 10, 20), got[10:20])
    assert not layer.rows("kv_lat")[7].any()
    layer.edited_from = 300
    layer.overwrite(np.array([4, 9]), **{name: value[:2] * 2 for name, value in rows.items()})
    layer.put_row(11, "k_rot", rows["k_rot"][0] * 3)
    assert layer.edited_from == 4  # put_row: the device's own row, not an edit
    def rounded(x: np.ndarray) -> np.ndarray:
        return decode_kv_rows(*encode_kv_rows(dtype, x))

    np.testing.assert_array_equal(layer.rows("kv_lat")[[4, 9]], rounded(rows["kv_lat"][:2] * 2))
    np.testing.assert_array_equal(layer.rows("k_rot")[11], rounded(rows["k_rot"][:1] * 3)[0])
    layer.truncate(120)
    copy = KVCache(config, dtype=dtype).layer(0)
    copy.append_encoded({name: layer.encoded(name, 0, 120) for name in rows})
    for name in rows:
        np.testing.assert_array_equal(copy.storage(name)[:120].view(np.uint8), layer.storage(name)[:120].view(np.uint8))
        np.testing.assert_array_equal(copy.rows(name), layer.rows(name))
    # f16's scales weigh more next to these narrow test rows than at real widths
    assert kv_bytes_per_token(config, dtype) < kv_bytes_per_token(config) / {"bf16": 1.9, "f16": 1.6, "fp8": 2.5}[dtype]
    with pytest.raises(ValueError, match="kv dtype"):
        KVCache(config, dtype="int8")


def test_kv_cache_overwrites_rows_in_place_and_marks_them_edited() -> None:
    config = tiny_config()
    rng = np.random.default_rng(8)
    layer = KVCache(config).layer(0)
    before = {"kv_lat": rand(rng, 10, 16), "k_rot": rand(rng, 10, 4), "index_k": rand(rng, 10, 8)}
    layer.append(**before)
    layer.edited_from = 10  # as after a device decode step took the rows
    positions = np.array([2, 5, 6])
    new = {"kv_lat": rand(rng, 3, 16), "k_rot": rand(rng, 3, 4), "index_k": rand(rng, 3, 8)}
    layer.overwrite(positions, **new)
    assert layer.length == 10 and layer.edited_from == 2
    for name, value in before.items():
        want = value.copy()
        want[positions] = new[name]
        np.testing.assert_array_equal(layer.rows(name), want)
    with pytest.raises(ValueError, match="positions"):
        layer.overwrite(np.array([9, 10]), **{name: value[:2] for name, value in new.items()})
    with pytest.raises(ValueError, match="expected rows"):
        layer.overwrite(positions, kv_lat=new["kv_lat"], k_rot=new["k_rot"])


# ---- whole model (self-consistency; exactness vs transformers is the tools/ check) -----------------

class DictWeights:
    def __init__(self, tensors: dict[str, Weight]) -> None:
        self.tensors = tensors

    def weight(self, name: str) -> Weight:
        return self.tensors[name]

    def has(self, name: str) -> bool:
        return name in self.tensors


def random_weights(config: ModelConfig, rng: np.random.Generator) -> dict[str, Weight]:
    """All tensors of a random model (indexer head pairs negated so index scores cannot tie at 0)."""
    h, c = config.hidden_size, config
    t: dict[str, Weight] = {"model.embed_tokens.weight": rand(rng, c.vocab_size, h),
                            "lm_head.weight": rand(rng, c.vocab_size, h) / np.sqrt(h),
                            "model.norm.weight": 1 + 0.2 * rand(rng, h)}

    def mat(name: str, out: int, inp: int) -> None:
        t[name] = rand(rng, out, inp) * np.float32(1.5 / np.sqrt(inp))

    def mlp(prefix: str, width: int) -> None:
        mat(prefix + "gate_proj.weight", width, h)
        mat(prefix + "up_proj.weight", width, h)
        mat(prefix + "down_proj.weight", h, width)

    for layer in range(c.num_layers_with_mtp):
        p = f"model.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_a_layernorm"):
            t[p + norm + ".weight"] = 1 + 0.2 * rand(rng, c.q_lora_rank if "q_a" in norm else h)
        t[p + "self_attn.kv_a_layernorm.weight"] = 1 + 0.2 * rand(rng, c.kv_lora_rank)
        mat(p + "self_attn.q_a_proj.weight", c.q_lora_rank, h)
        mat(p + "self_attn.q_b_proj.weight", c.num_attention_heads * c.qk_head_dim, c.q_lora_rank)
        mat(p + "self_attn.kv_a_proj_with_mqa.weight", c.kv_lora_rank + c.qk_rope_head_dim, h)
        mat(p + "self_attn.kv_b_proj.weight", c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim),
            c.kv_lora_rank)
        mat(p + "self_attn.o_proj.weight", h, c.num_attention_heads * c.v_head_dim)
        if c.indexer_type(layer) == "full":
            mat(p + "self_attn.indexer.wq_b.weight", c.index_n_heads * c.index_head_dim, c.q_lora_rank)
            heads = t[p + "self_attn.indexer.wq_b.weight"].reshape(c.index_n_heads, c.index_head_dim, -1)
            heads[1::2] = -heads[0::2]
            mat(p + "self_attn.indexer.wk.weight", c.index_head_dim, h)
            mat(p + "self_attn.indexer.weights_proj.weight", c.index_n_heads, h)
            t[p + "self_attn.indexer.k_norm.weight"] = 1 + 0.2 * rand(rng, c.index_head_dim)
            t[p + "self_attn.indexer.k_norm.bias"] = 0.2 * rand(rng, c.index_head_dim)
        if not c.is_moe_layer(layer):
            mlp(p + "mlp.", c.intermediate_size)
            continue
        mat(p + "mlp.gate.weight", c.n_routed_experts, h)
        t[p + "mlp.gate.e_score_correction_bias"] = 0.1 * rand(rng, c.n_routed_experts)
        mlp(p + "mlp.shared_experts.", c.moe_intermediate_size * c.n_shared_experts)
        for e in range(c.n_routed_experts):
            mlp(f"{p}mlp.experts.{e}.", c.moe_intermediate_size)
    n = c.num_hidden_layers
    mat(f"model.layers.{n}.eh_proj.weight", h, 2 * h)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        t[f"model.layers.{n}.{norm}.weight"] = 1 + 0.2 * rand(rng, h)
    return t


def test_prefill_decode_and_chunked_forward_agree_and_report_routes() -> None:
    config = tiny_config()
    weights = random_weights(config, np.random.default_rng(8))
    routes: list[tuple[int, np.ndarray]] = []
    model = GlmMoeDsaModel(config, DictWeights(weights), NumpyBackend(),
                           route_hook=lambda layer, ids, u: routes.append((layer, ids)))
    ids = np.random.default_rng(9).integers(0, config.vocab_size, 12)

    cache = model.new_cache()
    logits, hidden = model.forward(ids, cache)
    assert logits.shape == (12, config.vocab_size) and hidden.shape == (12, config.hidden_size)
    assert [layer for layer, _ in routes] == [1, 2] and routes[0][1].shape == (12, config.num_experts_per_tok)
    last, _ = model.forward(ids, model.new_cache(), last_logits_only=True)
    np.testing.assert_allclose(last, logits[-1:], rtol=1e-5, atol=1e-5)

    for chunk in (1, 3, 5):
        cache_c = model.new_cache()
        parts = [model.forward(ids[:4], cache_c)[0]]
        parts += [model.forward(ids[s: s + chunk], cache_c)[0] for s in range(4, 12, chunk)]
        np.testing.assert_allclose(np.concatenate(parts), logits, rtol=1e-4, atol=1e-4 * np.abs(logits).max())

    # MTP: all positions at once == one position at a time
    mtp_all, _ = model.mtp_forward(hidden[:-1], ids[1:], cache)
    cache.layer(config.num_hidden_layers).truncate(0)
    steps = [model.mtp_forward(hidden[i: i + 1], ids[i + 1: i + 2], cache)[0] for i in range(11)]
    np.testing.assert_allclose(np.concatenate(steps), mtp_all, rtol=1e-4, atol=1e-4 * np.abs(mtp_all).max())


def test_quantized_embedding_gathers_and_dequantizes_rows() -> None:
    rng = np.random.default_rng(10)
    table = quant(rand(rng, 20, 12), 4, 8)
    ids = np.array([3, 0, 3, 19])
    np.testing.assert_allclose(embed_rows(table, ids), table.dequantize()[ids], rtol=1e-6)


# ---- worker pool (prefill-sized calls split over threads) -------------------------------------

def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray, scale: float) -> np.ndarray:
    """Per query row and head: softmax over every key (masked to -inf), in float64."""
    heads = q.shape[1]
    k = np.broadcast_to(k, (k.shape[0], heads, k.shape[2])).astype(np.float64)
    v = np.broadcast_to(v, (v.shape[0], heads, v.shape[2])).astype(np.float64)
    scores = np.einsum("shd,thd->hst", q.astype(np.float64), k) * scale
    scores = np.where(allowed, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hst,thd->shd", probs, v)


@pytest.mark.parametrize("key_heads", [1, 5])
def test_attention_blocks_heads_and_skipped_keys_match_reference(key_heads: int) -> None:
    rng = np.random.default_rng(11)
    seq, total, heads = 37, 45, 5
    q, k, v = rand(rng, seq, heads, 12), rand(rng, total, key_heads, 12), rand(rng, total, key_heads, 7)
    allowed = causal_mask(3, seq, total)  # the last keys are nobody's: the blocks leave them out
    allowed[10:20, 2:9] = False  # sparse-selection holes
    expected = reference_attention(q, k, v, allowed, 0.3)
    serial = NumpyBackend(query_block=heads * total * 8).attention(q, k, v, allowed, 0.3)  # blocks of 8 rows
    pooled = NumpyBackend(query_block=heads * total * 8, workers=3).attention(q, k, v, allowed, 0.3)
    np.testing.assert_allclose(serial, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pooled, serial, rtol=1e-5, atol=1e-6)


def test_workers_give_the_same_products_indexer_and_moe() -> None:
    """Split calls agree with unsplit ones to float rounding (BLAS rounds a GEMM's edge columns differently)."""
    rng = np.random.default_rng(12)
    serial, pooled = NumpyBackend(prefill_block=200), NumpyBackend(prefill_block=200, workers=3)
    x = rand(rng, 23, 53)
    for w in (quant(rand(rng, 29, 53), 4, 16), quant(rand(rng, 29, 53), 8, None), rand(rng, 29, 53)):
        np.testing.assert_allclose(pooled.linear(x, w), serial.linear(x, w), rtol=1e-5, atol=1e-5)
    q, k, hw = rand(rng, 23, 3, 8), rand(rng, 30, 8), rand(rng, 23, 3)
    causal = causal_mask(7, 23, 30)
    for backend in (serial, pooled):
        backend.query_block = 3 * 30 * 4  # blocks of 4 query rows
    expected = np.einsum("sh,sht->st", hw, np.maximum(np.einsum("shd,td->sht", q, k) * 0.5, 0))
    for backend in (serial, pooled):
        np.testing.assert_array_equal(backend.index_topk(q, k, hw, 0.5, np.arange(7, 30), 6),
                                      chosen_keys(topk_mask(expected, causal, 6), 6))
    experts = {e: tuple(quant(rand(rng, *shape), 4, 16) for shape in ((16, 53), (16, 53), (53, 16)))
               for e in range(6)}
    shared = tuple(rand(rng, *shape) for shape in ((16, 53), (16, 53), (53, 16)))
    ids = np.stack([rng.permutation(6)[:2] for _ in range(23)])
    gates = rand(rng, 23, 2)
    np.testing.assert_allclose(pooled.moe(x, ids, gates, experts.__getitem__, shared),
                               serial.moe(x, ids, gates, experts.__getitem__, shared), rtol=1e-5, atol=1e-5)
    assert pooled.numerics != serial.numerics  # rows computed with another split are not reused as identical


@pytest.mark.parametrize("shape", [(64, 96), (700, 500)])
def test_times_transposed_matches_the_product_for_every_row_count(shape):
    from glmkit.backends.numpy_backend import GEMV_ROWS, times_transposed

    rng = np.random.default_rng(3)
    w = rng.standard_normal(shape).astype(np.float32)
    for rows in range(1, GEMV_ROWS + 3):
        x = rng.standard_normal((rows, shape[1])).astype(np.float32)
        got = times_transposed(x, w)
        assert got.shape == (rows, shape[0]) and got.dtype == np.float32
        np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4)


def test_renormalized_is_the_other_norm_of_the_same_hidden_state():
    """Read-ahead's estimate of the next layer's router input: one layer's normed input re-weighted as the next
    layer's norm weights it, exactly that norm of the same hidden state (0 where the first weight is 0)."""
    rng = np.random.default_rng(0)
    h = rng.standard_normal((3, 16)).astype(np.float32)
    w, w_next = rng.standard_normal(16).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    w[5] = 0.0
    backend = NumpyBackend()
    got = renormalized(backend.rms_norm(h, w, 1e-6), w, w_next)
    want = backend.rms_norm(h, w_next, 1e-6)
    want[:, 5] = 0.0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_f16_rows_beyond_its_range_are_scaled_by_a_power_of_two() -> None:
    """f16 KV rows whose largest magnitude exceeds F16_ROW_MAX keep a power-of-two scale (no infinities): they read
    back to f16's relative precision; rows within it keep scale 1 (their codes are the values' own)."""
    rows = np.array([[F16_ROW_MAX, -1.0, 0.5], [F16_ROW_MAX * 1.0001, 7.0, -3.0], [3e9, -1e6, 1.0]], np.float32)
    codes, scales = encode_kv_rows("f16", rows)
    assert scales.tolist() == [1.0, 2.0, 2.0 ** 17]
    assert np.isfinite(codes.astype(np.float32)).all()
    got = decode_kv_rows(codes, scales)
    assert (np.abs(got - rows) <= 2 ** -11 * np.abs(rows) + 2 ** -24 * scales[:, None]).all()
    np.testing.assert_array_equal(codes[0], rows[0].astype(np.float16))
