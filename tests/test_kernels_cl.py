"""Every OpenCL kernel against the NumPy reference, on the first OpenCL device (PoCL's CPU device in CI).

Sizes are odd on purpose (rows, columns and groups that do not divide the vector chunks, tails of every
loop). The program is built once per module (PoCL caches compiled kernels across runs); a second build with
LANES=8 runs the GPU-style code path (several work-items per row, local-memory reductions) on the same device.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from glmkit.formats.packing import pack, quantize
from glmkit.formats.tensors import QuantWeight
from glmkit.kernels_cl.launch import Kernels, WeightMemory, list_devices
from glmkit.runtime.backend import NumpyBackend, silu
from glmkit.runtime.model import apply_rope, rope_cos_sin, topk_mask

REF = NumpyBackend()


def first_device():
    devices = list_devices()
    if not devices:  # pyopencl[pocl] is a dependency: a missing device is a broken install, not a skip
        pytest.fail("no OpenCL device found (pyopencl with the pocl extra should provide PoCL's CPU device)")
    return next((d for d in devices if d.kind == "cpu"), devices[0])


@pytest.fixture(scope="module")
def kernels():
    return Kernels(first_device())


@pytest.fixture(scope="module")
def wide_kernels():
    """The GPU code path: 8 work-items per matvec row, 8-item reductions, vloadn loads, transfers instead of
    direct access."""
    return Kernels(first_device(), lanes=8, red_lanes=8, direct=False, cpu_loads=False)


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def make_weight(rng, rows, cols, bits, group):
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    if bits == 32:
        return w, w
    codes, scales = quantize(w, bits, group)
    q = QuantWeight(pack(codes, bits), scales, bits, group, (rows, cols))
    return q, q.dequantize()


def device_weight(k, w, unified=True):
    mem = WeightMemory(k, unified, 1 << 40)
    if isinstance(w, QuantWeight):
        return mem.weight(w.packed, w.scales, w.bits, w.group_size, w.shape)
    return mem.weight(w, None, 32, None, w.shape)


def close(got, want, tol=2e-6):
    scale = max(float(np.abs(want).max()), 1.0)
    assert got.shape == want.shape
    assert float(np.abs(got - want).max()) <= tol * scale


SCHEMES = [(32, None), (8, None), (8, 64), (8, 24), (4, None), (4, 64), (4, 24), (4, 32), (2, None), (2, 64), (2, 24)]


@pytest.mark.parametrize("bits,group", SCHEMES)
def test_matvec_matmul_dequant(kernels, rng, bits, group):
    for rows, cols in ((37, 100), (64, 128), (5, 7), (3, 203)):
        w, dense = make_weight(rng, rows, cols, bits, group)
        cw = device_weight(kernels, w)
        for n_s in (1, 3):
            x = rng.standard_normal((n_s, cols)).astype(np.float32)
            close(kernels.matvec(cw, x), x @ dense.T)
        x = rng.standard_normal((45, cols)).astype(np.float32)
        close(kernels.matmul(cw, x), x @ dense.T)
        assert np.array_equal(kernels.dequant(cw), dense)
        assert np.array_equal(kernels.dequant(cw, rows // 2), dense[rows // 2:])


@pytest.mark.parametrize("bits,group", [(32, None), (8, 24), (4, 64), (2, None)])
def test_head_products(kernels, rng, bits, group):
    heads, nope, v, lat = 3, 6, 5, 70  # kv_b: heads blocks of [nope | v] rows, lat columns
    w, _ = make_weight(rng, heads * (nope + v), lat, bits, group)
    cw = device_weight(kernels, w)
    q = rng.standard_normal((2, heads, nope)).astype(np.float32)
    close(kernels.matvec_t(cw, q, nope + v, 0, nope), REF.head_matmul(q, w, 0, nope, transpose=True))
    o = rng.standard_normal((2, heads, lat)).astype(np.float32)
    close(kernels.matvec(cw, o, heads, nope + v, nope, v), REF.head_matmul(o, w, nope, v, transpose=False))


def test_weights_in_place_from_a_mapping(kernels, rng, tmp_path):
    """A weight inside a read-only mmap is used in place (windows smaller than the file are exercised)."""
    w, dense = make_weight(rng, 50, 96, 4, 32)
    path = tmp_path / "blob"
    gap = 10_000  # packed bytes and scales far apart, at unaligned offsets
    with open(path, "wb") as f:
        f.write(b"\0" * 100 + w.packed.tobytes() + b"\0" * gap + w.scales.tobytes())
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    flat = np.frombuffer(m, np.uint8)
    packed = flat[100:100 + w.packed.nbytes].reshape(w.packed.shape)
    start = 100 + w.packed.nbytes + gap
    scales = flat[start:start + w.scales.nbytes].view(np.float32).reshape(w.scales.shape)
    mem = WeightMemory(kernels, True, 1 << 40)
    mem.window = 8192  # force several windows over the small file
    cw = mem.weight(packed, scales, 4, 32, w.shape)
    x = rng.standard_normal((1, 96)).astype(np.float32)
    close(kernels.matvec(cw, x), x @ dense.T)
    assert mem._own == {}  # nothing was copied into a buffer of its own
    del cw, mem, packed, scales, flat


def fused_reference(x, experts, slots):
    out = np.zeros_like(x)
    for tok, e, weight in slots:
        g, u, d = experts[e]
        out[tok] += weight * REF.expert_mlp(x[tok:tok + 1], g, u, d)[0]
    return out


def pack_experts(experts):
    """The experts' tensors back to back in one byte array (as an expert range is in a container)."""
    parts, offs, pos = [], [], 0
    for triple in experts:
        six = []
        for w in triple:
            for arr in (w.packed, w.scales):
                pad = (-pos) % 64
                parts.append(np.zeros(pad, np.uint8))
                pos += pad
                six.append(pos)
                parts.append(arr.reshape(-1).view(np.uint8))
                pos += arr.nbytes
        offs.append(six)
    return np.concatenate(parts), np.array(offs, np.uint64)


@pytest.mark.parametrize("bits,group", [(8, None), (4, 64), (4, 24), (2, 64)])
def test_fused_experts(kernels, wide_kernels, rng, bits, group):
    hidden, inter = 70, 45
    experts = [(make_weight(rng, inter, hidden, bits, group)[0], make_weight(rng, inter, hidden, bits, group)[0],
                make_weight(rng, hidden, inter, bits, group)[0]) for _ in range(4)]
    blob, offs = pack_experts(experts)
    x = rng.standard_normal((3, hidden)).astype(np.float32)
    slots = [(0, 1, 0.5), (0, 3, 1.5), (1, 0, 1.0), (2, 1, -0.25), (2, 2, 2.0), (2, 0, 0.1)]  # token 1: one expert
    want = fused_reference(x, experts, slots)
    g, d = experts[0][0], experts[0][2]
    n_groups = g.scales.shape[1] if g.scales.ndim == 2 else 1
    inter_groups = d.scales.shape[1] if d.scales.ndim == 2 else 1
    for k in (kernels, wide_kernels):
        buf = WeightMemory(k, k.direct, 1 << 40)._own_buffer(blob)[0]
        got = k.experts(buf, bits, group or 0, n_groups, hidden, inter, g.packed.shape[1], d.packed.shape[1],
                        inter_groups, x, offs[[s[1] for s in slots]], np.array([s[0] for s in slots], np.uint32),
                        np.array([0, 2, 3, 6], np.uint32), np.array([s[2] for s in slots], np.float32))
        close(got, want, 5e-6)


def test_wide_matvec(wide_kernels, rng):
    for bits, group in ((4, 64), (2, 24), (32, None)):
        w, dense = make_weight(rng, 33, 150, bits, group)
        cw = device_weight(wide_kernels, w, unified=False)
        x = rng.standard_normal((2, 150)).astype(np.float32)
        close(wide_kernels.matvec(cw, x), x @ dense.T)
        close(wide_kernels.matmul(cw, x.repeat(20, axis=0)), x.repeat(20, axis=0) @ dense.T)


@pytest.mark.parametrize("n", [1, 7, 64, 1000])
def test_norms_softmax_silu(kernels, wide_kernels, rng, n):
    x = (rng.standard_normal((5, n)) * 3).astype(np.float32)
    w, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    for k in (kernels, wide_kernels):
        close(k.rms_norm(x, w, 1e-6), REF.rms_norm(x, w, 1e-6))
        close(k.layer_norm(x, w, b, 1e-6), REF.layer_norm(x, w, b, 1e-6), 1e-5)
        masked = x.copy()
        masked[:, 1::3] = -np.inf  # column 0 stays finite
        e = np.exp(masked - masked.max(axis=1, keepdims=True))
        close(k.softmax(masked), e / e.sum(axis=1, keepdims=True))
        close(k.silu_mul(x, w * x), silu(x) * (w * x))


def test_rope_both_layouts(kernels, rng):
    n_s, heads, nope, rope = 3, 5, 6, 10
    cos, sin = rope_cos_sin(np.arange(40, 40 + n_s), rope, 10000.0)
    x = rng.standard_normal((n_s, heads, nope + rope)).astype(np.float32)
    # the main attention's layout: rope on the LAST dims; the indexer's: on the FIRST dims
    last = np.concatenate([x[..., :nope], apply_rope(x[..., nope:], cos, sin)], axis=-1)
    close(kernels.rope(x, cos, sin, nope, rope), last)
    first = np.concatenate([apply_rope(x[..., :rope], cos, sin), x[..., rope:]], axis=-1)
    close(kernels.rope(x, cos, sin, 0, rope), first)
    flat = rng.standard_normal((n_s, rope)).astype(np.float32)  # the shared key: [S, rope]
    close(kernels.rope(flat, cos, sin), apply_rope(flat, cos, sin))


@pytest.mark.parametrize("n_s,n_keys,shared", [(1, 1, True), (1, 301, True), (3, 77, True), (7, 33, False)])
def test_attention(kernels, wide_kernels, rng, n_s, n_keys, shared):
    heads, dk, dv = 4, 22, 13
    kh = 1 if shared else heads
    q = rng.standard_normal((n_s, heads, dk)).astype(np.float32)
    k = rng.standard_normal((n_keys, kh, dk)).astype(np.float32)
    v = rng.standard_normal((n_keys, kh, dv)).astype(np.float32)
    allowed = rng.random((n_s, n_keys)) < 0.6
    allowed[:, 0] = True
    want = REF.attention(q, k, v, allowed, dk ** -0.5)
    for kern in (kernels, wide_kernels):
        close(kern.attention(q, k, v, allowed, dk ** -0.5), want, 5e-6)


def test_index_scores_and_topk(kernels, rng):
    n_s, heads, d, n_keys, topk = 4, 3, 17, 90, 20
    q = rng.standard_normal((n_s, heads, d)).astype(np.float32)
    k = rng.standard_normal((n_keys, d)).astype(np.float32)
    w = rng.standard_normal((n_s, heads)).astype(np.float32)
    want = REF.index_scores(q, k, w, d ** -0.5)
    close(kernels.index_scores(q, k, w, d ** -0.5), want)
    causal = np.arange(n_keys)[None, :] <= (np.array([5, 40, 70, 89]))[:, None]  # row 0 keeps all 6 keys
    distinct = rng.permutation(n_s * n_keys).reshape(n_s, n_keys).astype(np.float32) - 100
    assert np.array_equal(kernels.topk(distinct, causal, topk), topk_mask(distinct, causal, topk))
    # index scores tie at 0 (every head's ReLU off): any choice among equal scores is a valid top-k
    got = kernels.index_topk(q, k, w, d ** -0.5, causal, topk)
    for row in range(n_s):
        allowed = want[row][causal[row]]
        picked = got[row] & causal[row]
        assert got[row].sum() == picked.sum() == min(topk, causal[row].sum())
        rest = want[row][causal[row] & ~got[row]]
        assert rest.size == 0 or want[row][picked].min() >= rest.max()
        assert picked.sum() == allowed.size or want[row][picked].min() == np.sort(allowed)[-topk]
    # negative scores, exact ties at the threshold: the lowest indices win
    tied = np.array([[-1.0, -3.0, -2.0, -2.0, -2.0, -5.0]], np.float32)
    got = kernels.topk(tied, np.ones_like(tied, bool), 3)
    assert got.tolist() == [[True, False, True, True, False, False]]
