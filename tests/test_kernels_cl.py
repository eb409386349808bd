"""Every OpenCL kernel against the NumPy reference, on PoCL's CPU device (or `GLMKIT_TEST_DEVICE`).

Sizes are odd on purpose (rows, columns and groups that do not divide the vector chunks, tails of every
loop). The program is built once per module (PoCL caches compiled kernels across runs); a second build with
LANES=8 runs the GPU-style code path (several work-items per row, local-memory reductions) on the same device.
"""

from __future__ import annotations

import mmap

import numpy as np
import pyopencl as cl
import pytest

from glmkit.backends.numpy_backend import NumpyBackend
from glmkit.backends.opencl.launch import NO_STAGE, Kernels, WeightMemory, x8_eligible
from glmkit.format.packing import pack, quantize, unpack
from glmkit.format.tensors import QuantWeight
from glmkit.model.ops import apply_rope, rope_cos_sin, silu, topk_mask
from tests.runtime_support import opencl_test_device

REF = NumpyBackend()


@pytest.fixture(scope="module")
def kernels():
    return Kernels(opencl_test_device())


@pytest.fixture(scope="module")
def wide_kernels():
    """The GPU code path: 8 work-items per matvec row, 8-item reductions, vloadn loads, transfers instead of
    direct access."""
    return Kernels(opencl_test_device(), lanes=8, red_lanes=8, direct=False, cpu_loads=False)


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


@pytest.mark.parametrize("bits,group", [(32, None), (8, 24), (8, None), (8, 64), (4, 64), (4, 32), (4, None),
                                        (2, None)])
@pytest.mark.parametrize("lat", [70, 128])
def test_head_products(kernels, wide_kernels, rng, bits, group, lat):
    """kv_b's per-head products; lat 128 takes matvec_t's 16-byte chunks for int4/int8 with whole groups."""
    heads, nope, v = 3, 6, 5  # kv_b: heads blocks of [nope | v] rows, lat columns
    w, _ = make_weight(rng, heads * (nope + v), lat, bits, group)
    q = rng.standard_normal((2, heads, nope)).astype(np.float32)
    o = rng.standard_normal((2, heads, lat)).astype(np.float32)
    for k in (kernels, wide_kernels):
        cw = device_weight(k, w, unified=k.direct)
        close(k.matvec_t(cw, q, nope + v, 0, nope), REF.head_matmul(q, w, 0, nope, transpose=True))
        close(k.matvec(cw, o, heads, nope + v, nope, v), REF.head_matmul(o, w, nope, v, transpose=False))


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
        # the device decode step's launches for token 2's slots: gate+up, down per slot, the slots' sum (a fourth
        # slot unused)
        mirror = Mirrors(k)
        step = [s for s in slots if s[0] == 2]
        host = {}
        for name, count, dtype, value in (
                ("x", hidden, np.float32, x[2]), ("offs", 6 * 4, np.uint64, offs[[e for _, e, _ in step] + [0]]),
                ("tok", 4, np.uint32, [0, 0, 0, 0xffffffff]), ("start", 2, np.uint32, [0, 3]),
                ("w", 4, np.float32, [w for _, _, w in step] + [9.0]), ("hid", 4 * inter, np.float32, 0),
                ("part", 4 * hidden, np.float32, 0), ("y", hidden, np.float32, 0)):
            host[name] = mirror(count, dtype)
            host[name][0][:] = np.reshape(value, -1) if np.ndim(value) else value
        b = {name: pair[1] for name, pair in host.items()}
        for launch in k.bind_experts(buf, bits, group or 0, n_groups, hidden, inter, g.packed.shape[1],
                                     d.packed.shape[1], inter_groups, b["x"], b["offs"], b["tok"], b["start"], b["w"],
                                     b["hid"], b["y"], 4, b["part"]):
            mirror.launch_bound(launch)
        close(host["y"][0], want[2], 5e-6)
        for i, (_, e, _) in enumerate(step):
            close(host["part"][0][i * hidden:(i + 1) * hidden], REF.expert_mlp(x[2:3], *experts[e])[0], 5e-6)


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


def test_index_scores_and_topk(kernels, wide_kernels, rng):
    """The selection on both builds: one work-item per row (CPUs), one work-group per row (GPUs)."""
    assert kernels.topk_kernel(4)[0] == ("topk_select" if kernels.lanes == 1 else "topk_select_group")
    assert wide_kernels.topk_kernel(4)[0] == "topk_select_group"
    for k in (kernels, wide_kernels):
        check_index_scores_and_topk(k, rng)
    # a long row: many keys per item of the group, ties at the threshold across items
    long = np.round(rng.standard_normal((2, 3000)) * 4).astype(np.float32)
    allowed = rng.random(long.shape) < 0.9
    for k in (kernels, wide_kernels):
        assert np.array_equal(k.topk(long, allowed, 700), topk_mask(long, allowed, 700))
        # the chosen lists (the decode step's attention keys): each row's selection in ascending order, also
        # where fewer keys than k are allowed
        for row_allowed in (allowed, rng.random(long.shape) < 0.2):
            mirror = Mirrors(k)
            (sh, sb), (ah, ab), (selh, selb), (ch, cb) = (mirror(long.size), mirror(long.size, np.uint8),
                                                          mirror(long.size, np.uint8), mirror(2 * 700, np.uint32))
            sh[:], ah[:] = long.reshape(-1), row_allowed.reshape(-1)
            name, size, local = k.topk_kernel(2)
            mirror.launch(name, size, local, sb, ab, selb, cb, long.shape[1], 700, 2)
            want = topk_mask(long, row_allowed, 700)
            assert np.array_equal(selh.reshape(want.shape).astype(bool), want)
            for row in range(2):
                chosen = np.flatnonzero(want[row])
                assert np.array_equal(ch[row * 700: row * 700 + len(chosen)], chosen)


def check_index_scores_and_topk(kernels, rng):
    n_s, heads, d, n_keys, topk = 4, 3, 17, 90, 20
    q = rng.standard_normal((n_s, heads, d)).astype(np.float32)
    k = rng.standard_normal((n_keys, d)).astype(np.float32)
    w = rng.standard_normal((n_s, heads)).astype(np.float32)
    want = REF.index_scores(q, k, w, d ** -0.5)
    close(kernels.index_scores(q, k, w, d ** -0.5), want)
    causal = np.arange(n_keys)[None, :] <= (np.array([5, 40, 70, 89]))[:, None]  # row 0 keeps all 6 keys
    distinct = rng.permutation(n_s * n_keys).reshape(n_s, n_keys).astype(np.float32) - 100
    assert np.array_equal(kernels.topk(distinct, causal, topk), topk_mask(distinct, causal, topk))
    # index scores tie at 0 (every head's ReLU off): the same keys as the NumPy selection (lowest indices)
    got = kernels.index_topk(q, k, w, d ** -0.5, causal, topk)
    assert (want == 0).sum() > n_s  # the case is exercised
    assert np.array_equal(got, topk_mask(want, causal, topk))
    # negative scores, exact ties at the threshold: the lowest indices win
    tied = np.array([[-1.0, -3.0, -2.0, -2.0, -2.0, -5.0]], np.float32)
    got = kernels.topk(tied, np.ones_like(tied, bool), 3)
    assert got.tolist() == [[True, False, True, True, False, False]]
    # -0 and +0 tie (an index score is -0 when a negative head weight meets an all-off ReLU): lowest indices win
    zeros = np.array([[0.0, -0.0, 1.0, -0.0, 0.0]], np.float32)
    assert kernels.topk(zeros, np.ones_like(zeros, bool), 3).tolist() == [[True, True, True, False, False]]
    assert topk_mask(zeros, np.ones_like(zeros, bool), 3).tolist() == [[True, True, True, False, False]]


# ---- the device decode step's kernels (decode.cl), launched through bound launches ---------------------

class Mirrors:
    """Host arrays and the device buffers kernels see: the same memory on direct devices (the step's case);
    elsewhere (a discrete GPU) every array is copied in before each launch and back after it."""

    def __init__(self, k: Kernels):
        self.k, self.pairs = k, []

    def __call__(self, count: int, dtype=np.float32) -> tuple[np.ndarray, object]:
        if self.k.direct:
            return self.k.host_buffer(count, dtype)
        host = np.zeros(max(count, 1), dtype)
        buf = cl.Buffer(self.k.ctx, cl.mem_flags.READ_WRITE, host.nbytes)
        self.pairs.append((host, buf))
        return host, buf

    def launch(self, name, size, local, *args):
        """Launch kernel `name` once through a bound launch and wait."""
        self.launch_bound(self.k.bind(name, size, local, *args))

    def launch_bound(self, launch):
        for host, buf in self.pairs:
            cl.enqueue_copy(self.k.queue, buf, host)
        launch.enqueue().wait()
        for host, buf in self.pairs:
            cl.enqueue_copy(self.k.queue, host, buf, is_blocking=True)


def test_decode_norms_and_rope(kernels, rng):
    mirror = Mirrors(kernels)
    n, rope, heads, width = 45, 10, 3, 17
    x, a = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    vec_h, vec = mirror(3 * n)
    vec_h[:] = rng.standard_normal(3 * n).astype(np.float32)
    xh, xb = mirror(n + 4)
    ah, ab = mirror(n)
    yh, yb = mirror(n + 9)
    xh[4:], ah[:] = x, a
    red = kernels.red_lanes
    (range_h, one), (weight_h, weight) = mirror(2, np.uint32), mirror(3)
    range_h[:], weight_h[:] = (0, 1), 1.0
    # x[4:] += a (one row of weight 1: exact), then the norm with the weights at vec[n:2n] into y[9:]
    mirror.launch("residual_rms_norm", (red,), (red,), xb, 4, ab, one, weight, 1, vec, n, yb, 9, n, 1e-5, 0, xb, xb,
                  xb)
    close(xh[4:], x + a, 0)
    close(yh[9:], REF.rms_norm((x + a)[None], vec_h[n:2 * n], 1e-5)[0])
    mirror.launch("residual_rms_norm", (red,), (red,), xb, 4, ab, one, weight, 0, vec, 0, yb, 0, n, 1e-6, 0, xb, xb,
                  xb)
    close(xh[4:], x + a, 0)  # add = 0 leaves x alone
    close(yh[:n], REF.rms_norm((x + a)[None], vec_h[:n], 1e-6)[0])
    # the experts' down rows with their routing weights: x += sum over rows 1 and 2 of w[s] * rows[s] (rows 0: unused)
    rows = rng.standard_normal((3, n)).astype(np.float32)
    (rows_h, rows_b), base = mirror(3 * n), xh[4:].copy()
    rows_h[:], range_h[:], weight_h[:] = rows.reshape(-1), (1, 3), (9.0, 0.5, -2.0)
    mirror.launch("residual_rms_norm", (red,), (red,), xb, 4, rows_b, one, weight, 1, vec, n, yb, 9, n, 1e-5, 0, xb,
                  xb, xb)
    close(xh[4:], base + (np.float32(0) + np.float32(0.5) * rows[1] + np.float32(-2.0) * rows[2]), 0)
    close(yh[9:], REF.rms_norm(xh[None, 4:], vec_h[n:2 * n], 1e-5)[0])
    # rope on the first `rope` columns of each of `heads` rows of width `width` read at stride 20, offset 2
    cos, sin = rope_cos_sin(np.array([77]), rope, 10000.0)
    cs_h, cs = mirror(rope)
    cs_h[:] = np.concatenate([cos[0], sin[0]])
    src_h, src = mirror(2 + 20 * heads)
    src_h[:] = rng.standard_normal(src_h.size).astype(np.float32)
    rows = np.stack([src_h[2 + 20 * h: 2 + 20 * h + width] for h in range(heads)])
    out_h, out = mirror(width * heads)
    mirror.launch("rope_rows", (width, heads), None, src, 2, 20, out, 0, width, cs, width, rope // 2)
    want = np.concatenate([apply_rope(rows[None, :, :rope], cos, sin)[0], rows[:, rope:]], axis=-1)
    close(out_h.reshape(heads, width), want)
    # the token's rows, the cache rows written at row 2 of the cache arrays: kv_lat = RMSNorm(latent), k_rot =
    # RoPE(rest) of kv_a's output; the query latent RMSNorm(q_a) (64 values, weights at vec[0:64]) and its int8
    # codes; the indexer key LayerNorm(raw) with RoPE on its first columns
    kvl, qn = n - rope, 64
    lat_h, lat = mirror(3 * kvl)
    rot_h, rot = mirror(3 * rope)
    (qa_h, qa), (qlat_h, qlat) = mirror(qn), mirror(qn)
    codes = [mirror(2 * qn, np.int8), mirror(1), mirror(1, np.int32)]
    qa_h[:] = rng.standard_normal(qn).astype(np.float32)
    tmp_h, tmp = mirror(n)
    key_h, key = mirror(3 * n)
    raw_h, raw = mirror(n)
    raw_h[:] = rng.standard_normal(n).astype(np.float32)
    stage_h, stage = mirror(3 + kvl + rope + n)
    for index, with_codes in ((0, 1), (1, 0)):  # a layer that shares its indexer writes no key row
        key_h[:] = 0
        codes[1][0][:] = 0
        stage_h[:] = 0
        # the first without a staging copy, the second with one, at stage[3:]
        mirror.launch("token_rows", (red,), (red,), ab, vec, n, lat, rot, 2, kvl, rope, cs, 1e-6, qa, 0, qlat, qn,
                      with_codes, *(c[1] for c in codes), index, raw, n, 2 * n, tmp, key, n, stage,
                      3 if index else NO_STAGE)
        if index:
            assert np.array_equal(stage_h[3:], np.concatenate([lat_h[2 * kvl:], rot_h[2 * rope:], key_h[2 * n:]]))
        else:
            assert not stage_h.any()
        close(lat_h[2 * kvl:], REF.rms_norm(a[None, :kvl], vec_h[n:n + kvl], 1e-6)[0])
        close(rot_h[2 * rope:], apply_rope(a[None, kvl:], cos, sin)[0])
        close(qlat_h, REF.rms_norm(qa_h[None], vec_h[:qn], 1e-6)[0])
        assert (key_h != 0).any() == bool(index)
        scale = quantize_activations(qlat_h[None])[1][0]
        assert np.array_equal(codes[1][0], scale if with_codes else [0.0])
    assert_codes(codes[0][0], quantize_activations(qlat_h[None])[0])
    normed = REF.layer_norm(raw_h[None], vec_h[n:2 * n], vec_h[2 * n:], 1e-6)
    close(key_h[2 * n:], np.concatenate([apply_rope(normed[:, :rope], cos, sin), normed[:, rope:]], axis=-1)[0],
          1e-5)


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, None)])
def test_mla_query(kernels, wide_kernels, rng, bits, group):
    """The decode step's query per head: its absorption through kv_b's nope rows (as matvec_t) and RoPE of its rope
    part (as rope_rows), in one launch."""
    heads, nope, rope, v, lat = 3, 6, 10, 5, 64
    w, _ = make_weight(rng, heads * (nope + v), lat, bits, group)
    q = rng.standard_normal((heads, nope + rope)).astype(np.float32)
    cos, sin = rope_cos_sin(np.array([33]), rope, 10000.0)
    for k in (kernels, wide_kernels):
        mirror = Mirrors(k)
        (qh, qb), (absh, absb), (roth, rotb), (csh, csb) = (mirror(q.size), mirror(heads * lat), mirror(heads * rope),
                                                            mirror(rope))
        qh[:], csh[:] = q.reshape(-1), np.concatenate([cos[0], sin[0]])
        cw = device_weight(k, w, unified=k.direct)
        mirror.launch_bound(k.bind_mla_query(cw, qb, nope + rope, absb, nope, nope + v, heads, csb, rotb, rope))
        close(absh.reshape(heads, lat), REF.head_matmul(q[None, :, :nope], w, 0, nope, transpose=True)[0])
        close(roth.reshape(heads, rope), apply_rope(q[None, :, nope:], cos, sin)[0])


@pytest.mark.parametrize("n_keys,use_mask,rope", [(1, False, 6), (37, True, 12), (300, True, 6), (129, False, 16)])
def test_decode_attention(kernels, wide_kernels, rng, n_keys, use_mask, rope):
    """Absorbed MLA attention of one token (scores, then softmax + values) against the backend's attention, on both
    builds (GPUs: an item per key and head in the scores, one latent column per item in the values)."""
    for k in (kernels, wide_kernels):
        check_decode_attention(k, rng, n_keys, use_mask, rope)


def check_decode_attention(kernels, rng, n_keys, use_mask, rope):
    mirror = Mirrors(kernels)
    # kvl (and some ropes) not a multiple of 8: the kernels' scalar tails; 11 heads: a partial second 8 in scores
    heads, kvl = (11 if n_keys > 100 else 3), 36
    q_lat, q_rot = rng.standard_normal((heads, kvl)).astype(np.float32), rng.standard_normal((heads, rope))
    kv_lat, k_rot = rng.standard_normal((n_keys, kvl)).astype(np.float32), rng.standard_normal((n_keys, rope))
    mask = rng.random(n_keys) < 0.5 if use_mask else np.ones(n_keys, bool)
    mask[0] = True
    keys = np.flatnonzero(mask).astype(np.uint32)  # the chosen keys (topk_select's list), read when use_mask
    n = len(keys) if use_mask else n_keys
    bufs = {}
    for name, arr, dtype in (("ql", q_lat, np.float32), ("qr", q_rot, np.float32), ("kl", kv_lat, np.float32),
                             ("kr", k_rot, np.float32), ("keys", keys, np.uint32)):
        host, buf = mirror(arr.size, dtype)
        host[:] = arr.reshape(-1)
        bufs[name] = buf
    scores_h, scores = mirror(heads * n)
    out_h, out = mirror(heads * kvl)
    scale = 0.17
    # the CPU launch (every head per item) or the GPU one (an item per key and head)
    apart = heads if kernels.heads_apart else 1
    mirror.launch("mla_decode_scores", (n, apart), None, bufs["ql"], bufs["qr"], bufs["kl"], bufs["kr"],
                  bufs["keys"], int(use_mask), scores, heads, n, kvl, rope, scale)
    red = kernels.red_lanes
    mirror.launch("mla_decode_values", (heads * red,), (red,), scores, bufs["kl"], out, n, kvl, 0, out, out,
                  out, bufs["keys"], int(use_mask))
    q = np.concatenate([q_lat, q_rot], axis=-1)[None].astype(np.float32)
    keys = np.concatenate([kv_lat, k_rot], axis=-1)[:, None, :].astype(np.float32)
    want = REF.attention(q, keys, kv_lat[:, None, :], mask[None], scale)[0]
    close(out_h.reshape(heads, kvl), want, 5e-6)


@pytest.mark.parametrize("norm", [True, False])
def test_decode_routing(kernels, rng, norm):
    """noaux_tc on the device against the model's `route_noaux_tc`: the slots it writes for the fused experts of
    each weight buffer (the chosen experts there by ascending id, then the shared expert's if it is there; the
    rest marked unused) and their weights."""
    mirror = Mirrors(kernels)
    from glmkit.model.ops import route_noaux_tc

    experts, n_group, topk_group, top_k, scaling, stride = 24, 4, 2, 5, 2.5, 32
    buffer_of = np.arange(experts + 1) % 3  # three weight buffers; the shared expert (last) in buffer 0
    table_h, table = mirror(6 * (experts + 1), np.uint64)
    table_h[:] = np.arange(table_h.size, dtype=np.uint64) * 1000 + 7
    where_h, where = mirror(experts + 1, np.uint32)
    where_h[:] = buffer_of
    for _ in range(20):
        logits = (rng.standard_normal(experts) * 2).astype(np.float32)
        bias = (rng.standard_normal(experts) * 0.1).astype(np.float32)
        lg_h, lg = mirror(experts)
        vec_h, vec = mirror(experts + 3)
        lg_h[:], vec_h[3:] = logits, bias
        offs_h, offs = mirror(3 * stride * 6, np.uint64)
        w_h, w = mirror(3 * stride)
        tok_h, tok = mirror(3 * stride, np.uint32)
        start_h, start = mirror(3 * stride, np.uint32)
        ids_h, ids = mirror(top_k, np.uint32)
        mirror.launch("route_noaux_tc", (1,), None, lg, vec, 3, table, where, 3, experts, n_group, topk_group, top_k,
              int(norm), scaling, 1, offs, w, tok, stride, start, ids)
        want_ids, want_w = route_noaux_tc(logits[None], bias, top_k, n_group, topk_group, norm, scaling)
        order = np.argsort(want_ids[0])
        assert ids_h.tolist() == want_ids[0][order].tolist()
        chosen = np.concatenate([want_ids[0][order], [experts]])
        weights = np.concatenate([want_w[0][order], [1.0]])
        for b in range(3):
            mine = buffer_of[chosen] == b
            n = int(mine.sum())
            assert start_h[b * stride: b * stride + 2].tolist() == [0, n]
            slots = slice(b * stride, b * stride + n)
            assert tok_h[slots].tolist() == [0] * n and (tok_h[b * stride + n:(b + 1) * stride] == 0xFFFFFFFF).all()
            np.testing.assert_allclose(w_h[slots], weights[mine], rtol=1e-6)
            want_offs = (chosen[mine][:, None] * 6 + np.arange(6)) * 1000 + 7
            assert offs_h.reshape(-1, 6)[slots].tolist() == want_offs.tolist()


# ---- int8 activations: the device decode step's int4 experts ----------------------------------------------

def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The arithmetic of common.cl's int8 activations: x `[S, N]` -> int codes `[S, N]` and float32 scales
    `[S, N / 64]`; per block of 64 columns scale = max|x| * (1 / 127) and codes = rint(x * (127 / max|x|)).
    (A GPU's division 127 / max|x| may be off by an ulp: a code then differs where x * inv is a half.)"""
    blocks = x.reshape(x.shape[0], -1, 64)
    m = np.abs(blocks).max(axis=-1, keepdims=True)
    inv = np.divide(np.float32(127), m, out=np.zeros_like(m), where=m > 0)
    return np.rint(blocks * inv).astype(np.int64).reshape(x.shape), m[..., 0] * np.float32(1 / 127)


def x8_linear(x: np.ndarray, w: QuantWeight) -> np.ndarray:
    """`x @ W^T` for int4/int8 W with x quantized: exact integer sums per block, scaled by weight scale x block
    scale."""
    q, s = quantize_activations(x)
    out_rows, n = w.shape
    codes = unpack(w.packed, w.bits, n).astype(np.int64).reshape(out_rows, -1, 64)
    sums = np.einsum("sbi,obi->sob", q.reshape(len(x), -1, 64), codes)
    w_scale = np.repeat(w.scales.reshape(out_rows, -1), w.group_size // 64, axis=1)
    return (sums * (w_scale[None] * s[:, None, :]).astype(np.float64)).sum(-1).astype(np.float32)


def x8_head_products(x: np.ndarray, w: QuantWeight, head_rows: int, row_start: int, rows: int) -> np.ndarray:
    """`x8_linear` per head: y[h] = x[h] . W[h * head_rows + row_start ...] for `rows` rows, x `[heads, n]`."""
    starts = [h * head_rows + row_start for h in range(len(x))]
    return np.stack([x8_linear(x[h:h + 1], QuantWeight(w.packed[s:s + rows], w.scales[s:s + rows], w.bits,
                                                       w.group_size, (rows, w.shape[1])))[0]
                     for h, s in enumerate(starts)])


def assert_codes(codes: np.ndarray, q: np.ndarray) -> None:
    """A buffer of quantized inputs against the reference codes `[rows, n]`: per block, 64 codes in the int4
    product's order (some permutation), then the same 64 in column order."""
    blocks = codes.reshape(-1, 2, 64)
    assert np.array_equal(blocks[:, 1], q.reshape(-1, 64))
    assert np.array_equal(np.sort(blocks[:, 0], axis=-1), np.sort(q.reshape(-1, 64), axis=-1))


@pytest.mark.parametrize("bits,group", [(4, 64), (4, 128), (8, 64)])
def test_fused_experts_int8_activations(kernels, wide_kernels, rng, bits, group):
    """quantize x, gate+up, quantize hid, down per slot, the slots' sum: each stage against the reference
    arithmetic, on the vpmaddubsw path (AVX2 CPUs) and the portable one (the wide build); unused slots are
    skipped."""
    hidden, inter = 256, 128
    assert x8_eligible(bits, group, hidden, inter) and not x8_eligible(bits, 32, hidden, inter)
    assert not x8_eligible(2, 64, hidden, inter) and not x8_eligible(bits, group, hidden, 96)
    experts = [(make_weight(rng, inter, hidden, bits, group)[0], make_weight(rng, inter, hidden, bits, group)[0],
                make_weight(rng, hidden, inter, bits, group)[0]) for _ in range(4)]
    blob, offs = pack_experts(experts)
    x = (rng.standard_normal(hidden) * 2).astype(np.float32)
    x[64:128] = 0.0  # an all-zero block: scale 0, codes 0
    slots = [(1, 0.5), (3, 1.5), (0, 1.0), (2, 7.0)]  # the last slot unused (token 0xffffffff)
    g, d = experts[0][0], experts[0][2]
    for k in (kernels, wide_kernels):
        mirror = Mirrors(k)
        wbuf = WeightMemory(k, k.direct, 1 << 40)._own_buffer(blob)[0]
        host = {}
        for name, count, dtype, value in (
                ("x", hidden, np.float32, x), ("offs", 6 * len(slots), np.uint64, offs[[e for e, _ in slots]]),
                ("tok", len(slots), np.uint32, [0, 0, 0, 0xffffffff]), ("start", 2, np.uint32, [0, 3]),
                ("w", len(slots), np.float32, [s[1] for s in slots]), ("hid", len(slots) * inter, np.float32, 0),
                ("y", hidden, np.float32, 0), ("xq", 2 * hidden, np.int8, 0), ("xs", hidden // 64, np.float32, 0),
                ("xsum", hidden // 64, np.int32, 0), ("hq", 2 * len(slots) * inter, np.int8, 0),
                ("hs", len(slots) * inter // 64, np.float32, 0), ("hsum", len(slots) * inter // 64, np.int32, 0),
                ("part", len(slots) * hidden, np.float32, 0)):
            host[name] = mirror(count, dtype)
            host[name][0][:] = np.reshape(value, -1) if np.ndim(value) else value
        buf = {name: pair[1] for name, pair in host.items()}
        x_codes = (buf["xq"], buf["xs"], buf["xsum"])
        launches = (k.bind_quantize(buf["x"], hidden, 1, x_codes),
                    *k.bind_experts_x8(wbuf, bits, group, g.scales.shape[1], hidden, inter, g.packed.shape[1],
                                       d.packed.shape[1], d.scales.shape[1], x_codes, buf["offs"], buf["tok"],
                                       buf["start"], buf["w"], buf["hid"], buf["y"], len(slots),
                                       (buf["hq"], buf["hs"], buf["hsum"]), buf["part"]))
        for launch in launches:
            mirror.launch_bound(launch)
        val = {name: pair[0] for name, pair in host.items()}
        q, s = quantize_activations(x[None])
        assert np.array_equal(val["xs"], s[0]) and np.array_equal(val["xsum"], q.reshape(-1, 64).sum(-1))
        assert_codes(val["xq"], q)
        hid = val["hid"].reshape(len(slots), inter)
        for i, (e, _) in enumerate(slots[:3]):
            gate, up = x8_linear(x[None], experts[e][0])[0], x8_linear(x[None], experts[e][1])[0]
            close(hid[i], silu(gate) * up, 2e-6)
        hq, hs = quantize_activations(hid[:3])
        assert np.array_equal(val["hs"][:3 * inter // 64], hs.reshape(-1))
        assert np.array_equal(val["hsum"][:3 * inter // 64], hq.reshape(-1, 64).sum(-1))
        assert_codes(val["hq"][:2 * 3 * inter], hq)
        want = sum(w * x8_linear(hid[i:i + 1], experts[e][2])[0] for i, (e, w) in enumerate(slots[:3]))
        close(val["y"], want, 2e-6)
        close(val["y"], fused_reference(x[None], experts, [(0, e, w) for e, w in slots[:3]])[0], 3e-2)


@pytest.mark.parametrize("bits", [4, 8])
def test_experts_x8_operation(kernels, wide_kernels, rng, bits):
    """`Kernels.experts_x8` (the fused experts of decode rows run operation by operation, e.g. on the CPU device
    that takes a GPU's overflow): three tokens with 2, 1 and 3 slots, each token's sum against the reference
    arithmetic of int8 activations (x8_linear) and, loosely, against the float MLP."""
    hidden, inter = 192, 128
    experts = [(make_weight(rng, inter, hidden, bits, 64)[0], make_weight(rng, inter, hidden, bits, 64)[0],
                make_weight(rng, hidden, inter, bits, 64)[0]) for _ in range(4)]
    blob, offs = pack_experts(experts)
    x = rng.standard_normal((3, hidden)).astype(np.float32)
    slots = [(0, 1, 0.5), (0, 3, 1.5), (1, 0, 1.0), (2, 1, -0.25), (2, 2, 2.0), (2, 0, 0.1)]
    want = np.zeros_like(x)
    for tok, e, w in slots:
        gate, up = x8_linear(x[tok:tok + 1], experts[e][0])[0], x8_linear(x[tok:tok + 1], experts[e][1])[0]
        want[tok] += w * x8_linear((silu(gate) * up)[None], experts[e][2])[0]
    g, d = experts[0][0], experts[0][2]
    for k in (kernels, wide_kernels):
        buf = WeightMemory(k, k.direct, 1 << 40)._own_buffer(blob)[0]
        tok, weight = np.array([s[0] for s in slots], np.uint32), np.array([s[2] for s in slots], np.float32)
        got = k.experts_x8(buf, bits, 64, g.scales.shape[1], hidden, inter, g.packed.shape[1], d.packed.shape[1],
                           d.scales.shape[1], x, offs[[s[1] for s in slots]], tok, np.array([0, 2, 3, 6], np.uint32),
                           weight)
        close(got, want, 2e-5)  # the hidden rows' codes may round differently where a product differs by an ulp
        close(got, fused_reference(x, experts, slots), 3e-2)


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_input_matvec_and_norm(kernels, wide_kernels, rng, bits):
    """mv_*_x8 over per-head input rows (kv_b's value product) against the reference arithmetic, and the
    RMSNorm that writes its output's codes too (the step's u and q_lat) against quantize_x8's."""
    heads, n, head_rows, rows = 3, 128, 40, 24
    w = make_weight(rng, heads * head_rows, n, bits, 64)[0]
    x = rng.standard_normal((heads, n)).astype(np.float32)
    want = x8_head_products(x, w, head_rows, 5, rows)
    for k in (kernels, wide_kernels):
        mirror = Mirrors(k)
        (xh, xb), (yh, yb) = mirror(heads * n), mirror(heads * rows)
        codes = [mirror(2 * heads * n, np.int8), mirror(heads * n // 64), mirror(heads * n // 64, np.int32)]
        xh[:] = x.reshape(-1)
        scratch = tuple(c[1] for c in codes)
        cw = device_weight(k, w, unified=k.direct)
        for launch in (k.bind_quantize(xb, n, heads, scratch),
                       k.bind_matvec_x8(cw, scratch, yb, heads, head_rows, 5, rows)):
            mirror.launch_bound(launch)
        close(yh.reshape(heads, rows), want, 2e-6)
        norm_codes = [mirror(2 * n, np.int8), mirror(n // 64), mirror(n // 64, np.int32)]
        (in_h, in_b), (wh, wb), (out_h, out_b) = mirror(n), mirror(n), mirror(n)
        in_h[:], wh[:] = x[0], rng.standard_normal(n).astype(np.float32)
        mirror.launch("residual_rms_norm", (k.red_lanes,), (k.red_lanes,), in_b, 0, in_b, in_b, in_b, 0, wb, 0, out_b,
                      0, n, 1e-6, 1, *(c[1] for c in norm_codes))
        close(out_h, REF.rms_norm(x[:1], wh, 1e-6)[0])
        q, s = quantize_activations(out_h[None])
        assert np.array_equal(norm_codes[1][0], s[0]) and np.array_equal(norm_codes[2][0], q.reshape(-1, 64).sum(-1))
        assert_codes(norm_codes[0][0], q)
        assert_codes(codes[0][0], quantize_activations(x)[0])
        # the attention values kernel, writing its per-head outputs' codes (o_lat for kv_b's value product)
        keys = 70
        (sh, sb), (kh, kb), (oh, ob) = mirror(heads * keys), mirror(keys * n), mirror(heads * n)
        value_codes = [mirror(2 * heads * n, np.int8), mirror(heads * n // 64), mirror(heads * n // 64, np.int32)]
        sh[:], kh[:] = rng.standard_normal(heads * keys), rng.standard_normal(keys * n)
        scores = sh.reshape(heads, keys).copy()
        mirror.launch("mla_decode_values", (heads * k.red_lanes,), (k.red_lanes,), sb, kb, ob, keys, n, 1,
                      *(c[1] for c in value_codes), sb, 0)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        close(oh.reshape(heads, n), (probs / probs.sum(-1, keepdims=True)) @ kh.reshape(keys, n), 1e-5)
        q, s = quantize_activations(oh.reshape(heads, n))
        assert np.array_equal(value_codes[1][0], s.reshape(-1))
        assert np.array_equal(value_codes[2][0], q.reshape(-1, 64).sum(-1))
        assert_codes(value_codes[0][0], q)


@pytest.mark.parametrize("bits", [4, 8])
def test_matvec_writes_its_codes(kernels, wide_kernels, rng, bits):
    """mvq_*_x8 (kv_b's value product, whose output o_proj takes as int8 input): the product as mv_*_x8's, and
    the codes of each 64 output rows its work-group wrote as quantize_x8's; devices with several lanes per row
    cannot (`writes_codes`: the step quantizes in a launch of its own there)."""
    assert kernels.writes_codes == (kernels.lanes == 1) and not wide_kernels.writes_codes
    if not kernels.writes_codes:
        pytest.skip("a GPU (GLMKIT_TEST_DEVICE) writes codes in a launch of their own")
    heads, n, head_rows, rows = 3, 128, 140, 128
    w = make_weight(rng, heads * head_rows, n, bits, 64)[0]
    x = rng.standard_normal((heads, n)).astype(np.float32)
    want = x8_head_products(x, w, head_rows, 7, rows)
    mirror = Mirrors(kernels)
    (xh, xb), (yh, yb) = mirror(heads * n), mirror(heads * rows)
    codes = [mirror(2 * heads * n, np.int8), mirror(heads * n // 64), mirror(heads * n // 64, np.int32)]
    out = [mirror(2 * heads * rows, np.int8), mirror(heads * rows // 64), mirror(heads * rows // 64, np.int32)]
    xh[:] = x.reshape(-1)
    scratch = tuple(c[1] for c in codes)
    cw = device_weight(kernels, w, unified=kernels.direct)
    for launch in (kernels.bind_quantize(xb, n, heads, scratch),
                   kernels.bind_matvec_x8(cw, scratch, yb, heads, head_rows, 7, rows, tuple(c[1] for c in out))):
        mirror.launch_bound(launch)
    close(yh.reshape(heads, rows), want, 2e-6)
    q, s = quantize_activations(yh[None])
    assert np.array_equal(out[1][0], s[0]) and np.array_equal(out[2][0], q.reshape(-1, 64).sum(-1))
    assert_codes(out[0][0], q)


@pytest.mark.parametrize("bits", [4, 8])
def test_matvec_pair(kernels, wide_kernels, rng, bits):
    """mv2_*_x8: two products of one quantized input in one launch (the step's q_a and kv_a), odd row counts, each
    as mv_*_x8's."""
    n, rows, rows2 = 192, 37, 21
    w, w2 = make_weight(rng, rows, n, bits, 64)[0], make_weight(rng, rows2, n, bits, 64)[0]
    x = rng.standard_normal((1, n)).astype(np.float32)
    for k in (kernels, wide_kernels):
        mirror = Mirrors(k)
        (xh, xb), (yh, yb), (y2h, y2b) = mirror(n), mirror(rows), mirror(rows2)
        codes = [mirror(2 * n, np.int8), mirror(n // 64), mirror(n // 64, np.int32)]
        xh[:] = x[0]
        scratch = tuple(c[1] for c in codes)
        cw, cw2 = device_weight(k, w, unified=k.direct), device_weight(k, w2, unified=k.direct)
        for launch in (k.bind_quantize(xb, n, 1, scratch), k.bind_matvec_pair(cw, cw2, scratch, yb, y2b)):
            mirror.launch_bound(launch)
        close(yh, x8_linear(x, w)[0], 2e-6)
        close(y2h, x8_linear(x, w2)[0], 2e-6)
