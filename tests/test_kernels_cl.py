"""Every OpenCL kernel against the NumPy reference, on PoCL's CPU device (or `GLMKIT_TEST_DEVICE`).

Sizes are odd on purpose (rows, columns and groups that do not divide the vector chunks, tails of every
loop). The program is built once per module (PoCL caches compiled kernels across runs); a second build with
LANES=8 runs the GPU-style code path (several work-items per row, local-memory reductions) on the same device.
"""

from __future__ import annotations

import mmap
import warnings
from typing import NamedTuple

import numpy as np
import pyopencl as cl
import pytest

from glmkit.backends.numpy_backend import NumpyBackend
from glmkit.backends.opencl.buffers import DeviceArray, Int8Codes
from glmkit.backends.opencl.decode_graph import NO_STAGE
from glmkit.backends.opencl.decode_launches import (
    ExpertSlots,
    bind_experts,
    bind_experts_x8,
    bind_matvec_pair,
    bind_matvec_x8,
    bind_mla_query,
    bind_quantize,
)
from glmkit.backends.opencl.kernels import source
from glmkit.backends.opencl.ops import Kernels
from glmkit.backends.opencl.program import SCALAR_TYPES, kernel_signatures, parse_signatures
from glmkit.backends.opencl.weights import ExpertShape, WeightMemory, x8_eligible
from glmkit.format.packing import code_values, pack, quantize, unpack
from glmkit.format.tensors import QuantWeight
from glmkit.model.kv_cache import F16_ROW_MAX, decode_kv_rows, encode_kv_rows
from glmkit.model.ops import apply_rope, chosen_keys, rope_cos_sin, silu, topk_mask
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


# ---- kernel arguments by name ------------------------------------------------------------------------------

def test_signatures_are_the_compilers(kernels):
    """Every kernel the program builds, its parameters' names and scalar types as parsed from the source
    (macro-stamped kernels and shared parameter blocks expanded) against the compiler's own argument info."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the compiler's notes (float16 ABI on AVX2)
        program = cl.Program(kernels.ctx, source()).build(options=["-cl-kernel-arg-info"])
    built = program.get_info(cl.program_info.KERNEL_NAMES).split(";")
    signatures = kernel_signatures()
    assert sorted(built) == sorted(signatures) and len(built) > 50
    for name in built:
        kernel = cl.Kernel(program, name)
        count = kernel.get_info(cl.kernel_info.NUM_ARGS)
        names = tuple(kernel.get_arg_info(i, cl.kernel_arg_info.NAME) for i in range(count))
        types = [kernel.get_arg_info(i, cl.kernel_arg_info.TYPE_NAME) for i in range(count)]
        assert names == signatures[name].names, name
        want = tuple(None if t.endswith("*") else SCALAR_TYPES[t] for t in types)
        assert want == signatures[name].scalars, name


def test_parse_signatures_expands_stamping_macros():
    text = """
    /* __kernel void commented_out(uint a) */
    #define ARGS __global const float* w, \\
                 uint n
    #define ONE(NAME, T) __kernel void NAME(ARGS, T scale, __global float* y) { }
    #define TWO(SUFFIX) ONE(a_##SUFFIX, float) \\
                        ONE(b_##SUFFIX##_x, uint)
    TWO(q4)
    __kernel __attribute__((reqd_work_group_size(8, 8, 1))) void plain(__global uchar* bytes, ulong off) { }
    """
    sig = parse_signatures(text)
    assert sorted(sig) == ["a_q4", "b_q4_x", "plain"]
    assert sig["a_q4"].names == ("w", "n", "scale", "y") and sig["a_q4"].scalars == (None, np.uint32, np.float32, None)
    assert sig["b_q4_x"].scalars == (None, np.uint32, np.uint32, None)
    assert sig["plain"].names == ("bytes", "off") and sig["plain"].scalars == (None, np.uint64)
    with pytest.raises(ValueError, match="half h"):
        parse_signatures("__kernel void k(half h) { }")


def test_launch_arguments_by_name(kernels):
    """A bound launch takes every parameter by name, and `set` changes single ones between enqueues."""
    mirror = Mirrors(kernels)
    y, a, b = mirror.of([1.0, 2.0, 3.0]), mirror.of([10.0, 20.0, 30.0]), mirror.of([100.0, 200.0, 300.0])
    add = kernels.bind("add_into", (3,), None, y=y.buffer, a=a.buffer, n=3)
    mirror.launch_bound(add)
    assert y.host.tolist() == [11.0, 22.0, 33.0]
    add.set(a=b.buffer, n=2)
    mirror.launch_bound(add)
    assert y.host.tolist() == [111.0, 222.0, 33.0]
    with pytest.raises(TypeError, match="no parameter m"):
        add.set(m=1)
    with pytest.raises(TypeError, match=r"missing arguments \['n'\], unknown arguments \['count'\]"):
        kernels.bind("add_into", (3,), None, y=y.buffer, a=a.buffer, count=3)


def make_weight(rng, rows, cols, kind, group):
    """A random weight of `kind` (bits, or "nl4": 4-bit codes of the nl4 table) and its dequantized values."""
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    if kind == 32:
        return w, w
    bits, scheme = (4, "nl4") if kind == "nl4" else (kind, "symmetric")
    codes, scales = quantize(w, bits, group, scheme=scheme)
    q = QuantWeight(pack(codes, bits), scales, bits, group, (rows, cols), scheme)
    return q, q.dequantize()


def expert_shape(g: QuantWeight, d: QuantWeight) -> ExpertShape:
    """How the fused expert kernels read experts with gate (and up) like `g` and down like `d`."""
    return ExpertShape(g.bits, g.group_size or 0, g.scales.shape[1] if g.scales.ndim == 2 else 1, g.shape[1],
                       g.shape[0], g.packed.shape[1], d.packed.shape[1], d.scales.shape[1] if d.scales.ndim == 2
                       else 1, g.scheme)


def device_weight(k, w, unified=True):
    mem = WeightMemory(k.buffers, unified, 1 << 40)
    if isinstance(w, QuantWeight):
        return mem.weight(w.packed, w.scales, w.bits, w.group_size, w.shape, w.scheme)
    return mem.weight(w, None, 32, None, w.shape)


def close(got, want, tol=2e-6):
    scale = max(float(np.abs(want).max()), 1.0)
    assert got.shape == want.shape
    assert float(np.abs(got - want).max()) <= tol * scale


SCHEMES = [(32, None), (8, None), (8, 64), (8, 24), (4, None), (4, 64), (4, 24), (4, 32), ("nl4", None), ("nl4", 64),
           ("nl4", 24), ("nl4", 32), (3, None), (3, 64), (3, 24), (3, 128), (2, None), (2, 64), (2, 24)]


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
                                        ("nl4", 64), ("nl4", 32), ("nl4", None), (3, 64), (3, None), (2, None)])
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
    mem = WeightMemory(kernels.buffers, True, 1 << 40)
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


@pytest.mark.parametrize("bits,group", [(8, None), (4, 64), (4, 24), ("nl4", 64), ("nl4", 24), (3, 64), (3, 24),
                                        (2, 64)])
def test_fused_experts(kernels, wide_kernels, rng, bits, group):
    hidden, inter = 70, 45
    experts = [(make_weight(rng, inter, hidden, bits, group)[0], make_weight(rng, inter, hidden, bits, group)[0],
                make_weight(rng, hidden, inter, bits, group)[0]) for _ in range(4)]
    blob, offs = pack_experts(experts)
    x = rng.standard_normal((3, hidden)).astype(np.float32)
    slots = [(0, 1, 0.5), (0, 3, 1.5), (1, 0, 1.0), (2, 1, -0.25), (2, 2, 2.0), (2, 0, 0.1)]  # token 1: one expert
    want = fused_reference(x, experts, slots)
    shape = expert_shape(experts[0][0], experts[0][2])
    for k in (kernels, wide_kernels):
        buf = WeightMemory(k.buffers, k.direct, 1 << 40)._own_buffer(blob)[0]
        got = k.experts(buf, shape, x, offs[[s[1] for s in slots]], np.array([s[0] for s in slots], np.uint32),
                        np.array([0, 2, 3, 6], np.uint32), np.array([s[2] for s in slots], np.float32))
        close(got, want, 5e-6)
        # the device decode step's launches for token 2's slots: gate+up, down per slot, the slots' sum (a fourth
        # slot unused)
        mirror = Mirrors(k)
        step = [s for s in slots if s[0] == 2]
        a = {"x": mirror.of(x[2]), "offs": mirror.of(offs[[e for _, e, _ in step] + [0]], np.uint64),
             "tok": mirror.of([0, 0, 0, 0xffffffff], np.uint32), "start": mirror.of([0, 3], np.uint32),
             "w": mirror.of([w for _, _, w in step] + [9.0]), "hid": mirror(4 * inter), "part": mirror(4 * hidden),
             "y": mirror(hidden)}
        slots_b = ExpertSlots(a["offs"].buffer, a["tok"].buffer, a["start"].buffer, a["w"].buffer, 4)
        for launch in bind_experts(k, buf, shape, a["x"].buffer, slots_b, a["hid"].buffer, a["part"].buffer,
                                   a["y"].buffer):
            mirror.launch_bound(launch)
        close(a["y"].host, want[2], 5e-6)
        for i, (_, e, _) in enumerate(step):
            close(a["part"].host[i * hidden:(i + 1) * hidden], REF.expert_mlp(x[2:3], *experts[e])[0], 5e-6)


def test_wide_matvec(wide_kernels, rng):
    for bits, group in ((4, 64), ("nl4", 64), (2, 24), (32, None)):
        w, dense = make_weight(rng, 33, 150, bits, group)
        cw = device_weight(wide_kernels, w, unified=False)
        x = rng.standard_normal((2, 150)).astype(np.float32)
        close(wide_kernels.matvec(cw, x), x @ dense.T)
        close(wide_kernels.matmul(cw, x.repeat(20, axis=0)), x.repeat(20, axis=0) @ dense.T)


@pytest.mark.parametrize("n", [1, 7, 64, 1000])
def test_norms_silu(kernels, wide_kernels, rng, n):
    x = (rng.standard_normal((5, n)) * 3).astype(np.float32)
    w, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    for k in (kernels, wide_kernels):
        close(k.rms_norm(x, w, 1e-6), REF.rms_norm(x, w, 1e-6))
        close(k.layer_norm(x, w, b, 1e-6), REF.layer_norm(x, w, b, 1e-6), 1e-5)
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
        assert np.array_equal(k.topk(long, allowed, 700), chosen_keys(topk_mask(long, allowed, 700), 700))
        # the chosen lists (the decode step's attention keys): each row's selection in ascending order, also
        # where fewer keys than k are allowed
        for row_allowed in (allowed, rng.random(long.shape) < 0.2):
            mirror = Mirrors(k)
            scores, allowed_b = mirror.of(long), mirror.of(row_allowed, np.uint8)
            selected, chosen_b = mirror(long.size, np.uint8), mirror(2 * 700, np.uint32)
            name, size, local = k.topk_kernel(2)
            mirror.launch(name, size, local, scores=scores.buffer, allowed=allowed_b.buffer, selected=selected.buffer,
                          chosen=chosen_b.buffer, n_keys=long.shape[1], k=700, n_rows=2)
            want = topk_mask(long, row_allowed, 700)
            assert np.array_equal(selected.host.reshape(want.shape).astype(bool), want)
            for row in range(2):
                chosen = np.flatnonzero(want[row])
                assert np.array_equal(chosen_b.host[row * 700: row * 700 + len(chosen)], chosen)


@pytest.mark.parametrize("heads, d", [(8, 64), (11, 20), (16, 24), (3, 17)])
def test_index_scores_kernel_heads_in_eights_and_the_rest(kernels, rng, heads, d):
    """index_scores takes 8 heads at a time (their sums reduced together) and the rest one by one, with the columns
    past the last 8 of each row: against the NumPy scores for head counts and widths that hit each part."""
    n_s, n_keys = 3, 70
    q = rng.standard_normal((n_s, heads, d)).astype(np.float32)
    k = rng.standard_normal((n_keys, d)).astype(np.float32)
    w = rng.standard_normal((n_s, heads)).astype(np.float32)
    mirror = Mirrors(kernels)
    out = mirror(n_s * n_keys)
    keys = mirror.of(k).buffer
    mirror.launch("index_scores", (n_keys, n_s), None, q=mirror.of(q).buffer, k=keys, k_scale=keys,
                  w=mirror.of(w).buffer, out=out.buffer, nh=heads, d=d, n_keys=n_keys, scale=d ** -0.5, w_scale=0.5)
    close(out.host.reshape(n_s, n_keys), 0.5 * index_scores_reference(q, k, w, d ** -0.5))


def index_scores_reference(q, k, w, scale):
    """DSA indexer scores: `I[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t] * scale)`, q `[S, nh, d]`, k `[T, d]`."""
    return np.einsum("sh,sht->st", w, np.maximum(np.einsum("shd,td->sht", q, k) * scale, 0)).astype(np.float32)


def check_index_scores_and_topk(kernels, rng):
    n_s, heads, d, n_keys, topk = 4, 3, 17, 90, 20
    q = rng.standard_normal((n_s, heads, d)).astype(np.float32)
    k = rng.standard_normal((n_keys, d)).astype(np.float32)
    w = rng.standard_normal((n_s, heads)).astype(np.float32)
    want = index_scores_reference(q, k, w, d ** -0.5)
    # the scores kernel as the decode step binds it, the head weights scaled in the kernel (w_scale)
    mirror = Mirrors(kernels)
    out = mirror(n_s * n_keys)
    keys = mirror.of(k).buffer
    mirror.launch("index_scores", (n_keys, n_s), None, q=mirror.of(q).buffer, k=keys, k_scale=keys,
                  w=mirror.of(w).buffer, out=out.buffer, nh=heads, d=d, n_keys=n_keys, scale=d ** -0.5, w_scale=0.5)
    close(out.host.reshape(n_s, n_keys), 0.5 * want)
    causal = np.arange(n_keys)[None, :] <= (np.array([5, 40, 70, 89]))[:, None]  # row 0 keeps all 6 keys
    distinct = rng.permutation(n_s * n_keys).reshape(n_s, n_keys).astype(np.float32) - 100
    assert np.array_equal(kernels.topk(distinct, causal, topk), chosen_keys(topk_mask(distinct, causal, topk), topk))
    # index scores tie at 0 (every head's ReLU off): the same keys as the NumPy selection (lowest indices)
    got = kernels.index_topk(q, k, w, d ** -0.5, causal, topk)
    assert (want == 0).sum() > n_s  # the case is exercised
    assert np.array_equal(got, chosen_keys(topk_mask(want, causal, topk), topk))
    # negative scores, exact ties at the threshold: the lowest indices win
    tied = np.array([[-1.0, -3.0, -2.0, -2.0, -2.0, -5.0]], np.float32)
    got = kernels.topk(tied, np.ones_like(tied, bool), 3)
    assert got.tolist() == [[0, 2, 3]]
    # -0 and +0 tie (an index score is -0 when a negative head weight meets an all-off ReLU): lowest indices win
    zeros = np.array([[0.0, -0.0, 1.0, -0.0, 0.0]], np.float32)
    assert kernels.topk(zeros, np.ones_like(zeros, bool), 3).tolist() == [[0, 1, 2]]
    assert topk_mask(zeros, np.ones_like(zeros, bool), 3).tolist() == [[True, True, True, False, False]]


# ---- the device decode step's kernels (decode.cl), launched through bound launches ---------------------

class MirroredCodes(NamedTuple):
    """The arrays of int8-quantized rows (codes, scales, code sums) that a kernel writes or reads."""

    codes: DeviceArray
    scales: DeviceArray
    sums: DeviceArray

    @property
    def buffers(self) -> Int8Codes:
        return Int8Codes(self.codes.buffer, self.scales.buffer, self.sums.buffer)


class Mirrors:
    """Host arrays and the device buffers kernels see (`DeviceArray`s, zeroed): the same memory on direct devices
    (the step's case); elsewhere (a discrete GPU) every array is copied in before each launch and back after it."""

    def __init__(self, k: Kernels):
        self.k, self.arrays = k, []

    def __call__(self, count: int, dtype=np.float32) -> DeviceArray:
        if self.k.direct:
            a = self.k.buffers.array(count, dtype)
            a.host[:] = 0
            return a
        host = np.zeros(max(count, 1), dtype)
        a = DeviceArray(host, cl.Buffer(self.k.ctx, cl.mem_flags.READ_WRITE, host.nbytes))
        self.arrays.append(a)
        return a

    def of(self, values, dtype=np.float32) -> DeviceArray:
        """An array holding `values` (flattened)."""
        values = np.asarray(values, dtype).reshape(-1)
        a = self(values.size, dtype)
        a.host[:] = values
        return a

    def codes(self, n: int) -> MirroredCodes:
        """Arrays for the int8 codes of n values (codes, scales, code sums; one block's scale for n < 64)."""
        blocks = max(n // 64, 1)
        return MirroredCodes(self(2 * n, np.int8), self(blocks), self(blocks, np.int32))

    def launch(self, name, size, local, **args):
        """Launch kernel `name` once through a bound launch and wait."""
        self.launch_bound(self.k.bind(name, size, local, **args))

    def launch_bound(self, launch):
        for a in self.arrays:
            cl.enqueue_copy(self.k.queue, a.buffer, a.host)
        launch.enqueue().wait()
        for a in self.arrays:
            cl.enqueue_copy(self.k.queue, a.host, a.buffer, is_blocking=True)


def test_decode_norms_and_rope(kernels, rng):
    mirror = Mirrors(kernels)
    n, rope, heads, width = 45, 10, 3, 17
    x, a = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    vec = mirror.of(rng.standard_normal(3 * n))
    xa, aa, ya = mirror.of(np.concatenate([np.zeros(4), x])), mirror.of(a), mirror(n + 9)
    red = kernels.red_lanes
    one, weight = mirror.of([0, 1], np.uint32), mirror.of(np.ones(3))
    unused = Int8Codes.unused(xa.buffer)

    def norm(a_rows, add, w_off, y_off, eps):
        mirror.launch("residual_rms_norm", (red,), (red,), x=xa.buffer, x_off=4, a=a_rows, a_range=one.buffer,
                      a_w=weight.buffer, add=add, w=vec.buffer, w_off=w_off, y=ya.buffer, y_off=y_off, n=n, eps=eps,
                      quantize=0, **unused.args())

    # x[4:] += a (one row of weight 1: exact), then the norm with the weights at vec[n:2n] into y[9:]
    norm(aa.buffer, 1, n, 9, 1e-5)
    close(xa.host[4:], x + a, 0)
    close(ya.host[9:], REF.rms_norm((x + a)[None], vec.host[n:2 * n], 1e-5)[0])
    norm(aa.buffer, 0, 0, 0, 1e-6)
    close(xa.host[4:], x + a, 0)  # add = 0 leaves x alone
    close(ya.host[:n], REF.rms_norm((x + a)[None], vec.host[:n], 1e-6)[0])
    # the experts' down rows with their routing weights: x += sum over rows 1 and 2 of w[s] * rows[s] (rows 0: unused)
    rows = rng.standard_normal((3, n)).astype(np.float32)
    rows_a, base = mirror.of(rows), xa.host[4:].copy()
    one.host[:], weight.host[:] = (1, 3), (9.0, 0.5, -2.0)
    norm(rows_a.buffer, 1, n, 9, 1e-5)
    close(xa.host[4:], base + (np.float32(0) + np.float32(0.5) * rows[1] + np.float32(-2.0) * rows[2]), 0)
    close(ya.host[9:], REF.rms_norm(xa.host[None, 4:], vec.host[n:2 * n], 1e-5)[0])
    # rope on the first `rope` columns of each of `heads` rows of width `width` read at stride 20, offset 2
    cos, sin = rope_cos_sin(np.array([77]), rope, 10000.0)
    cs = mirror.of(np.concatenate([cos[0], sin[0]]))
    src = mirror.of(rng.standard_normal(2 + 20 * heads))
    rows = np.stack([src.host[2 + 20 * h: 2 + 20 * h + width] for h in range(heads)])
    out = mirror(width * heads)
    mirror.launch("rope_rows", (width, heads), None, x=src.buffer, x_off=2, x_row=20, y=out.buffer, y_off=0,
                  y_row=width, cs=cs.buffer, width=width, n_half=rope // 2, per_cs=heads)
    want = np.concatenate([apply_rope(rows[None, :, :rope], cos, sin)[0], rows[:, rope:]], axis=-1)
    close(out.host.reshape(heads, width), want)
    # the token's rows, the cache rows written at row 2 of the cache arrays: kv_lat = RMSNorm(latent), k_rot =
    # RoPE(rest) of kv_a's output; the query latent RMSNorm(q_a) (64 values, weights at vec[0:64]) and its int8
    # codes; the indexer key LayerNorm(raw) with RoPE on its first columns
    kvl, qn = n - rope, 64
    lat, rot = mirror(3 * kvl), mirror(3 * rope)
    qa, qlat = mirror.of(rng.standard_normal(qn)), mirror(qn)
    codes = mirror.codes(qn)
    tmp, key, raw = mirror(n), mirror(3 * n), mirror.of(rng.standard_normal(n))
    stage = mirror(3 + kvl + rope + n)
    for index, with_codes in ((0, 1), (1, 0)):  # a layer that shares its indexer writes no key row
        key.host[:] = 0
        codes.scales.host[:] = 0
        stage.host[:] = 0
        # the first without a staging copy, the second with one, at stage[3:]
        mirror.launch("token_rows", (red,), (red,), comp=aa.buffer, vec=vec.buffer, w_off=n, kv_lat=lat.buffer,
                      k_rot=rot.buffer, row=2, kvl=kvl, rope=rope, cs=cs.buffer, eps=1e-6, q_a=qa.buffer, qw_off=0,
                      q_lat=qlat.buffer, qn=qn, quantize=with_codes, **codes.buffers.args(), index=index,
                      key_raw=raw.buffer, kw_off=n, kb_off=2 * n, tmp=tmp.buffer, index_k=key.buffer, ihd=n,
                      stage=stage.buffer, stage_off=3 if index else NO_STAGE)
        if index:
            assert np.array_equal(stage.host[3:],
                                  np.concatenate([lat.host[2 * kvl:], rot.host[2 * rope:], key.host[2 * n:]]))
        else:
            assert not stage.host.any()
        close(lat.host[2 * kvl:], REF.rms_norm(a[None, :kvl], vec.host[n:n + kvl], 1e-6)[0])
        close(rot.host[2 * rope:], apply_rope(a[None, kvl:], cos, sin)[0])
        close(qlat.host, REF.rms_norm(qa.host[None], vec.host[:qn], 1e-6)[0])
        assert (key.host != 0).any() == bool(index)
        scale = quantize_activations(qlat.host[None])[1][0]
        assert np.array_equal(codes.scales.host, scale if with_codes else [0.0])
    assert_codes(codes.codes.host, quantize_activations(qlat.host[None])[0])
    normed = REF.layer_norm(raw.host[None], vec.host[n:2 * n], vec.host[2 * n:], 1e-6)
    close(key.host[2 * n:], np.concatenate([apply_rope(normed[:, :rope], cos, sin), normed[:, rope:]], axis=-1)[0],
          1e-5)


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), ("nl4", 32), (8, None)])
def test_mla_query(kernels, wide_kernels, rng, bits, group):
    """The decode step's query per head: its absorption through kv_b's nope rows (as matvec_t) and RoPE of its rope
    part (as rope_rows), in one launch."""
    heads, nope, rope, v, lat = 3, 6, 10, 5, 64
    w, _ = make_weight(rng, heads * (nope + v), lat, bits, group)
    q = rng.standard_normal((heads, nope + rope)).astype(np.float32)
    cos, sin = rope_cos_sin(np.array([33]), rope, 10000.0)
    for k in (kernels, wide_kernels):
        mirror = Mirrors(k)
        qa, absorbed, rot = mirror.of(q), mirror(heads * lat), mirror(heads * rope)
        cs = mirror.of(np.concatenate([cos[0], sin[0]]))
        cw = device_weight(k, w, unified=k.direct)
        mirror.launch_bound(bind_mla_query(k, cw, qa.buffer, nope + rope, absorbed.buffer, nope, nope + v, heads,
                                           cs.buffer, rot.buffer, rope))
        close(absorbed.host.reshape(heads, lat), REF.head_matmul(q[None, :, :nope], w, 0, nope, transpose=True)[0])
        close(rot.host.reshape(heads, rope), apply_rope(q[None, :, nope:], cos, sin)[0])


@pytest.mark.parametrize("n_keys,use_mask,rope", [(1, False, 6), (37, True, 12), (300, True, 6), (129, False, 16)])
def test_decode_attention(kernels, wide_kernels, rng, n_keys, use_mask, rope):
    """Absorbed MLA attention of one token (scores, then softmax + values) against the backend's attention, on both
    builds (GPUs: an item per key and head in the scores, one latent column per item in the values)."""
    for k in (kernels, wide_kernels):
        check_decode_attention(k, rng, n_keys, use_mask, rope)


@pytest.mark.parametrize("kv_dtype", ["bf16", "f16", "fp8"])
def test_decode_attention_over_compact_rows(kernels, rng, kv_dtype):
    """The attention kernels built for bf16 / f16 / fp8 cache rows (kv.cl's KV_TYPE): the same attention as over the
    rows those codes decode to (`decode_kv_rows`)."""
    for n_keys, use_mask, rope in [(37, True, 12), (129, False, 16)]:
        check_decode_attention(kernels, rng, n_keys, use_mask, rope, kv_dtype)


def mirror_rows(mirror: Mirrors, rows: np.ndarray, kv_dtype: str) -> tuple[DeviceArray, DeviceArray, np.ndarray]:
    """Rows `[n, w]` as a cache holds them at `kv_dtype`: (codes, scales (f16, fp8; else the codes again), the float
    rows they decode to)."""
    codes, scales = encode_kv_rows(kv_dtype, rows)
    raw = codes.view({"f32": np.float32, "bf16": np.uint16, "f16": np.uint16, "fp8": np.uint8}[kv_dtype])
    codes_a = mirror.of(raw, raw.dtype)
    return codes_a, codes_a if scales is None else mirror.of(scales), decode_kv_rows(codes, scales)


def check_decode_attention(kernels, rng, n_keys, use_mask, rope, kv_dtype="f32"):
    mirror = Mirrors(kernels)
    # kvl (and some ropes) not a multiple of 8: the kernels' scalar tails; 11 heads: a partial second 8 in scores
    heads, kvl = (11 if n_keys > 100 else 3), 36
    q_lat, q_rot = rng.standard_normal((heads, kvl)).astype(np.float32), rng.standard_normal((heads, rope))
    kl, kl_scale, kv_lat = mirror_rows(mirror, rng.standard_normal((n_keys, kvl)), kv_dtype)
    kr, kr_scale, k_rot = mirror_rows(mirror, rng.standard_normal((n_keys, rope)), kv_dtype)
    mask = rng.random(n_keys) < 0.5 if use_mask else np.ones(n_keys, bool)
    mask[0] = True
    keys = np.flatnonzero(mask).astype(np.uint32)  # the chosen keys (topk_select's list), read when use_mask
    n = len(keys) if use_mask else n_keys
    keys_a = mirror.of(keys, np.uint32)
    scores, out = mirror(heads * n), mirror(heads * kvl)
    scale = 0.17
    # the CPU launch (every head per item) or the GPU one (an item per key and head)
    apart = heads if kernels.heads_apart else 1
    mirror.launch("mla_decode_scores", (n, apart), None, kv_dtype=kv_dtype, q_lat=mirror.of(q_lat).buffer,
                  q_rot=mirror.of(q_rot).buffer, kv_lat=kl.buffer, kv_lat_scale=kl_scale.buffer, k_rot=kr.buffer,
                  k_rot_scale=kr_scale.buffer, keys=keys_a.buffer, use_keys=int(use_mask), scores=scores.buffer,
                  nh=heads, n=n, n_total=n, kvl=kvl, rope=rope, scale=scale)
    red = kernels.red_lanes
    mirror.launch("mla_decode_values", (heads * red,), (red,), kv_dtype=kv_dtype, scores=scores.buffer,
                  kv_lat=kl.buffer, kv_lat_scale=kl_scale.buffer, out=out.buffer, n=n, n_total=n, kvl=kvl, quantize=0,
                  **Int8Codes.unused(out.buffer).args(), keys=keys_a.buffer, use_keys=int(use_mask))
    q = np.concatenate([q_lat, q_rot], axis=-1)[None].astype(np.float32)
    keys = np.concatenate([kv_lat, k_rot], axis=-1)[:, None, :].astype(np.float32)
    want = REF.attention(q, keys, kv_lat[:, None, :], mask[None], scale)[0]
    close(out.host.reshape(heads, kvl), want, 5e-6)


@pytest.mark.parametrize("kv_dtype", ["f32", "bf16", "f16", "fp8"])
def test_kv_store_rows_codes_as_the_host_encodes_them(kernels, rng, kv_dtype):
    """kv_store_rows (the decode step's new cache row) writes the codes and scales `encode_kv_rows` makes, bit for
    bit: ties of bf16's, f16's and e4m3's rounding, values below e4m3's and f16's normal ranges, a zero row,
    negative zeros, an f16 row beyond F16_ROW_MAX (scaled by a power of two)."""
    kvl, rope, ihd = 40, 12, 24
    rows = [rng.standard_normal(w).astype(np.float32) * 10.0 ** rng.integers(-3, 3) for w in (kvl, rope, ihd)]
    rows[0][:4] = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -0.0, 2 ** -12], np.float32) * np.abs(rows[0]).max()
    rows[0][4:8] = np.float32(np.abs(rows[0]).max()) * np.array([9 / 448, 4.5 / 448, 1e-4, -3e-5], np.float32)
    rows[0][8:12] = np.float32(np.abs(rows[0]).max()) * np.array([1 + 2 ** -11, 1 + 3 * 2 ** -11, 2 ** -20, 2 ** -26],
                                                                 np.float32)
    rows[1][:] = 0.0  # a zero row: scale 1
    rows[2][:3] = [F16_ROW_MAX * 3.0, -F16_ROW_MAX * 2.0 ** 20, 2 ** -30]  # f16: scaled by 2^21
    mirror = Mirrors(kernels)
    outs = [mirror_rows(mirror, np.zeros((3, w), np.float32), kv_dtype)[:2] for w in (kvl, rope, ihd)]
    red = kernels.red_lanes
    mirror.launch("kv_store_rows", (red,), (red,), kv_dtype=kv_dtype, lat=mirror.of(rows[0]).buffer,
                  rot=mirror.of(rows[1]).buffer, idx=mirror.of(rows[2]).buffer, kv_lat=outs[0][0].buffer,
                  kv_lat_scale=outs[0][1].buffer, k_rot=outs[1][0].buffer, k_rot_scale=outs[1][1].buffer,
                  index_k=outs[2][0].buffer, index_k_scale=outs[2][1].buffer, row=1, kvl=kvl, rope=rope, ihd=ihd,
                  index=1)
    for row, (codes, scales) in zip(rows, outs, strict=True):
        want_codes, want_scales = encode_kv_rows(kv_dtype, row[None])
        width = len(row)
        got = codes.host.reshape(3, width)
        assert np.array_equal(got[1].view(np.uint8), want_codes[0].view(np.uint8)), (kv_dtype, width)
        assert not got[0].any() and not got[2].any()  # only row 1 written
        if want_scales is not None:
            assert scales.host[1] == want_scales[0]


@pytest.mark.parametrize("norm", [True, False])
def test_decode_routing(kernels, rng, norm):
    """noaux_tc on the device against the model's `route_noaux_tc`: the slots it writes for the fused experts of
    each weight buffer (the chosen experts there by ascending id, then the shared expert's if it is there; the
    rest marked unused) and their weights; `route_select` and the host's `_fill_slots` (the expert cache's step)
    write the same slots."""
    mirror = Mirrors(kernels)
    from glmkit.model.ops import route_noaux_tc

    experts, n_group, topk_group, top_k, scaling, stride = 24, 4, 2, 5, 2.5, 32
    buffer_of = np.arange(experts + 1) % 3  # three weight buffers; the shared expert (last) in buffer 0
    table = mirror.of(np.arange(6 * (experts + 1), dtype=np.uint64) * 1000 + 7, np.uint64)
    where = mirror.of(buffer_of, np.uint32)
    for _ in range(20):
        logits = (rng.standard_normal(experts) * 2).astype(np.float32)
        bias = (rng.standard_normal(experts) * 0.1).astype(np.float32)
        offs, w = mirror(3 * stride * 6, np.uint64), mirror(3 * stride)
        tok, start, ids = mirror(3 * stride, np.uint32), mirror(3 * stride, np.uint32), mirror(top_k, np.uint32)
        mirror.launch("route_noaux_tc", (1,), None, logits=mirror.of(logits).buffer,
                      vec=mirror.of(np.concatenate([np.zeros(3), bias])).buffer, bias_off=3, table=table.buffer,
                      buffer_of=where.buffer, n_buffers=3, n_experts=experts, n_group=n_group, topk_group=topk_group,
                      top_k=top_k, norm=int(norm), scaling=scaling, shared=1, offs=offs.buffer, slot_w=w.buffer,
                      slot_tok=tok.buffer, stride=stride, tok_start=start.buffer, ids=ids.buffer, n_tok=1)
        want_ids, want_w = route_noaux_tc(logits[None], bias, top_k, n_group, topk_group, norm, scaling)
        order = np.argsort(want_ids[0])
        assert ids.host.tolist() == want_ids[0][order].tolist()
        chosen = np.concatenate([want_ids[0][order], [experts]])
        weights = np.concatenate([want_w[0][order], [1.0]])
        for b in range(3):
            mine = buffer_of[chosen] == b
            n = int(mine.sum())
            assert start.host[b * stride: b * stride + 2].tolist() == [0, n]
            slots = slice(b * stride, b * stride + n)
            assert tok.host[slots].tolist() == [0] * n
            assert (tok.host[b * stride + n:(b + 1) * stride] == 0xFFFFFFFF).all()
            np.testing.assert_allclose(w.host[slots], weights[mine], rtol=1e-6)
            want_offs = (chosen[mine][:, None] * 6 + np.arange(6)) * 1000 + 7
            assert offs.host.reshape(-1, 6)[slots].tolist() == want_offs.tolist()
    # two tokens at once (MTP's verification over the expert cache): the same slots as route_noaux_tc's for both
    logits = (rng.standard_normal((2, experts)) * 2).astype(np.float32)
    vec = mirror.of(np.concatenate([np.zeros(3), bias])).buffer
    offs, w = mirror(3 * stride * 6, np.uint64), mirror(3 * stride)
    tok, start, ids = mirror(3 * stride, np.uint32), mirror(3 * stride, np.uint32), mirror(2 * top_k, np.uint32)
    mirror.launch("route_noaux_tc", (1,), None, logits=mirror.of(logits).buffer, vec=vec, bias_off=3,
                  table=table.buffer, buffer_of=where.buffer, n_buffers=3, n_experts=experts, n_group=n_group,
                  topk_group=topk_group, top_k=top_k, norm=int(norm), scaling=scaling, shared=1, offs=offs.buffer,
                  slot_w=w.buffer, slot_tok=tok.buffer, stride=stride, tok_start=start.buffer, ids=ids.buffer, n_tok=2)
    for t in range(2):
        chosen = np.concatenate([np.sort(route_noaux_tc(logits[t:t + 1], bias, top_k, n_group, topk_group, norm,
                                                        scaling)[0][0]), [experts]])
        for b in range(3):
            mine = buffer_of[chosen] == b
            first, n = int(start.host[b * stride + t]), int(mine.sum())
            assert tok.host[b * stride + first:b * stride + first + n].tolist() == [t] * n
            want_offs = (chosen[mine][:, None] * 6 + np.arange(6)) * 1000 + 7
            assert offs.host.reshape(-1, 6)[b * stride + first:b * stride + first + n].tolist() == want_offs.tolist()
    assert ids.host.tolist() == [e for t in range(2) for e in np.sort(route_noaux_tc(
        logits[t:t + 1], bias, top_k, n_group, topk_group, norm, scaling)[0][0])]


@pytest.mark.parametrize("n_tok", [1, 2])
def test_arena_routing(kernels, rng, n_tok):
    """`route_arena` (the expert cache's decode step): the model's noaux_tc choice and weights, each token's routed
    expert i in slot t * members + i with the offsets of where the cache's place table says it lies within its arena
    chunk, run by that chunk's first launch set; an expert the table lists as not read (-1) in no launch set yet;
    the after sets all unused; the shared experts' slots (placed by the host) untouched."""
    from glmkit.model.ops import route_noaux_tc

    mirror = Mirrors(kernels)
    experts, n_group, topk_group, top_k, scaling, chunks, stride = 24, 4, 2, 5, 2.5, 3, 32
    members, chunk_bytes = top_k + 1, 10_000
    rel = np.arange(6, dtype=np.uint64) * 100 + 3
    unused = 0xFFFFFFFF
    for norm in (True, False):
        for _ in range(10):
            logits = (rng.standard_normal((n_tok, experts)) * 2).astype(np.float32)
            bias = (rng.standard_normal(experts) * 0.1).astype(np.float32)
            places = rng.integers(0, chunks * chunk_bytes // 8, 2 * experts) * 8  # 2 layers of places
            places[rng.random(2 * experts) < 0.3] = -1
            offs = mirror.of(np.full(n_tok * members * 6, 1, np.uint64), np.uint64)
            w = mirror.of(np.full(n_tok * members, -1.0))
            first = mirror.of(np.full(chunks * stride, 7), np.uint32)  # 7: untouched
            after = mirror.of(np.full(chunks * stride, 7), np.uint32)
            ids = mirror(n_tok * top_k, np.uint32)
            mirror.launch("route_arena", (1,), None, logits=mirror.of(logits).buffer,
                          vec=mirror.of(np.concatenate([np.zeros(3), bias])).buffer, bias_off=3, n_experts=experts,
                          n_group=n_group, topk_group=topk_group, top_k=top_k, norm=int(norm), scaling=scaling,
                          places=mirror.of(places, np.int64).buffer, places_off=experts,
                          rel=mirror.of(rel, np.uint64).buffer, chunk_bytes=chunk_bytes, n_chunks=chunks,
                          members=members, stride=stride, offs=offs.buffer, slot_w=w.buffer, first=first.buffer,
                          after=after.buffer, ids=ids.buffer, n_tok=n_tok)
            first_c, after_c = first.host.reshape(chunks, stride), after.host.reshape(chunks, stride)
            for t in range(n_tok):
                want_ids, want_w = route_noaux_tc(logits[t:t + 1], bias, top_k, n_group, topk_group, norm, scaling)
                order = np.argsort(want_ids[0])
                assert ids.host[t * top_k:(t + 1) * top_k].tolist() == want_ids[0][order].tolist()
                for i, e in enumerate(want_ids[0][order]):
                    slot, place = t * members + i, places[experts + e]
                    np.testing.assert_allclose(w.host[slot], want_w[0][order][i], rtol=1e-6)
                    assert (after_c[:, slot] == unused).all()
                    if place < 0:
                        assert (first_c[:, slot] == unused).all()
                        continue
                    assert first_c[:, slot].tolist() == [t if c == place // chunk_bytes else unused
                                                         for c in range(chunks)]
                    assert offs.host.reshape(-1, 6)[slot].tolist() == (place % chunk_bytes + rel).tolist()
                shared = t * members + top_k
                assert (first_c[:, shared] == 7).all() and w.host[shared] == -1.0 and (
                    offs.host.reshape(-1, 6)[shared] == 1).all()



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
    """`x @ W^T` for int3/int4/nl4/int8 W with x quantized: exact integer sums per block (nl4: of its levels),
    scaled by weight scale x block scale."""
    q, s = quantize_activations(x)
    out_rows, n = w.shape
    codes = code_values(unpack(w.packed, w.bits, n), w.scheme).astype(np.int64).reshape(out_rows, -1, 64)
    sums = np.einsum("sbi,obi->sob", q.reshape(len(x), -1, 64), codes)
    w_scale = np.repeat(w.scales.reshape(out_rows, -1), w.group_size // 64, axis=1)
    return (sums * (w_scale[None] * s[:, None, :]).astype(np.float64)).sum(-1).astype(np.float32)


def x8_head_products(x: np.ndarray, w: QuantWeight, head_rows: int, row_start: int, rows: int) -> np.ndarray:
    """`x8_linear` per head: y[h] = x[h] . W[h * head_rows + row_start ...] for `rows` rows, x `[heads, n]`."""
    starts = [h * head_rows + row_start for h in range(len(x))]
    return np.stack([x8_linear(x[h:h + 1], QuantWeight(w.packed[s:s + rows], w.scales[s:s + rows], w.bits,
                                                       w.group_size, (rows, w.shape[1]), w.scheme))[0]
                     for h, s in enumerate(starts)])


def assert_codes(codes: np.ndarray, q: np.ndarray) -> None:
    """A buffer of quantized inputs against the reference codes `[rows, n]`: per block, 64 codes in the int4
    product's order (some permutation), then the same 64 in column order."""
    blocks = codes.reshape(-1, 2, 64)
    assert np.array_equal(blocks[:, 1], q.reshape(-1, 64))
    assert np.array_equal(np.sort(blocks[:, 0], axis=-1), np.sort(q.reshape(-1, 64), axis=-1))


@pytest.mark.parametrize("bits,group", [(4, 64), (4, 128), ("nl4", 64), ("nl4", 128), (8, 64), (3, 64), (3, 128)])
def test_fused_experts_int8_activations(kernels, wide_kernels, rng, bits, group):
    """quantize x, gate+up, quantize hid, down per slot, the slots' sum: each stage against the reference
    arithmetic, on the vpmaddubsw path (AVX2 CPUs) and the portable one (the wide build); unused slots are
    skipped."""
    hidden, inter = 256, 128
    experts = [(make_weight(rng, inter, hidden, bits, group)[0], make_weight(rng, inter, hidden, bits, group)[0],
                make_weight(rng, hidden, inter, bits, group)[0]) for _ in range(4)]
    stored = experts[0][0].bits
    assert x8_eligible(stored, group, hidden, inter) and not x8_eligible(stored, 32, hidden, inter)
    assert not x8_eligible(2, 64, hidden, inter) and not x8_eligible(stored, group, hidden, 96)
    blob, offs = pack_experts(experts)
    x = (rng.standard_normal(hidden) * 2).astype(np.float32)
    x[64:128] = 0.0  # an all-zero block: scale 0, codes 0
    slots = [(1, 0.5), (3, 1.5), (0, 1.0), (2, 7.0)]  # the last slot unused (token 0xffffffff)
    shape = expert_shape(experts[0][0], experts[0][2])
    for k in (kernels, wide_kernels):
        mirror = Mirrors(k)
        wbuf = WeightMemory(k.buffers, k.direct, 1 << 40)._own_buffer(blob)[0]
        xa, offs_a = mirror.of(x), mirror.of(offs[[e for e, _ in slots]], np.uint64)
        tok, start = mirror.of([0, 0, 0, 0xffffffff], np.uint32), mirror.of([0, 3], np.uint32)
        weights = mirror.of([s[1] for s in slots])
        hid, y, part = mirror(len(slots) * inter), mirror(hidden), mirror(len(slots) * hidden)
        x_codes, hid_codes = mirror.codes(hidden), mirror.codes(len(slots) * inter)
        launches = (bind_quantize(k, xa.buffer, hidden, 1, x_codes.buffers),
                    *bind_experts_x8(k, wbuf, shape, x_codes.buffers,
                                     ExpertSlots(offs_a.buffer, tok.buffer, start.buffer, weights.buffer, len(slots)),
                                     hid.buffer, hid_codes.buffers, part.buffer, y.buffer))
        for launch in launches:
            mirror.launch_bound(launch)
        q, s = quantize_activations(x[None])
        assert np.array_equal(x_codes.scales.host, s[0]) and np.array_equal(x_codes.sums.host,
                                                                            q.reshape(-1, 64).sum(-1))
        assert_codes(x_codes.codes.host, q)
        hidden_rows = hid.host.reshape(len(slots), inter)
        for i, (e, _) in enumerate(slots[:3]):
            gate, up = x8_linear(x[None], experts[e][0])[0], x8_linear(x[None], experts[e][1])[0]
            close(hidden_rows[i], silu(gate) * up, 2e-6)
        hq, hs = quantize_activations(hidden_rows[:3])
        assert np.array_equal(hid_codes.scales.host[:3 * inter // 64], hs.reshape(-1))
        assert np.array_equal(hid_codes.sums.host[:3 * inter // 64], hq.reshape(-1, 64).sum(-1))
        assert_codes(hid_codes.codes.host[:2 * 3 * inter], hq)
        want = sum(w * x8_linear(hidden_rows[i:i + 1], experts[e][2])[0] for i, (e, w) in enumerate(slots[:3]))
        close(y.host, want, 2e-6)
        close(y.host, fused_reference(x[None], experts, [(0, e, w) for e, w in slots[:3]])[0], 3e-2)


@pytest.mark.parametrize("bits", [3, 4, "nl4", 8])
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
    shape = expert_shape(experts[0][0], experts[0][2])
    for k in (kernels, wide_kernels):
        buf = WeightMemory(k.buffers, k.direct, 1 << 40)._own_buffer(blob)[0]
        tok, weight = np.array([s[0] for s in slots], np.uint32), np.array([s[2] for s in slots], np.float32)
        got = k.experts_x8(buf, shape, x, offs[[s[1] for s in slots]], tok, np.array([0, 2, 3, 6], np.uint32),
                           weight)
        close(got, want, 2e-5)  # the hidden rows' codes may round differently where a product differs by an ulp
        close(got, fused_reference(x, experts, slots), 3e-2)


@pytest.mark.parametrize("bits", [3, 4, "nl4", 8])
def test_int8_input_matvec_and_norm(kernels, wide_kernels, rng, bits):
    """mv_*_x8 over per-head input rows (kv_b's value product) against the reference arithmetic, and the
    RMSNorm that writes its output's codes too (the step's u and q_lat) against quantize_x8's."""
    heads, n, head_rows, rows = 3, 128, 40, 24
    w = make_weight(rng, heads * head_rows, n, bits, 64)[0]
    x = rng.standard_normal((heads, n)).astype(np.float32)
    want = x8_head_products(x, w, head_rows, 5, rows)
    for k in (kernels, wide_kernels):
        mirror = Mirrors(k)
        xa, y, codes = mirror.of(x), mirror(heads * rows), mirror.codes(heads * n)
        cw = device_weight(k, w, unified=k.direct)
        for launch in (bind_quantize(k, xa.buffer, n, heads, codes.buffers),
                       bind_matvec_x8(k, cw, codes.buffers, y.buffer, heads, head_rows, 5, rows)):
            mirror.launch_bound(launch)
        close(y.host.reshape(heads, rows), want, 2e-6)
        norm_codes = mirror.codes(n)
        norm_in, norm_w, out = mirror.of(x[0]), mirror.of(rng.standard_normal(n)), mirror(n)
        mirror.launch("residual_rms_norm", (k.red_lanes,), (k.red_lanes,), x=norm_in.buffer, x_off=0,
                      a=norm_in.buffer, a_range=norm_in.buffer, a_w=norm_in.buffer, add=0, w=norm_w.buffer, w_off=0,
                      y=out.buffer, y_off=0, n=n, eps=1e-6, quantize=1, **norm_codes.buffers.args())
        close(out.host, REF.rms_norm(x[:1], norm_w.host, 1e-6)[0])
        q, s = quantize_activations(out.host[None])
        assert np.array_equal(norm_codes.scales.host, s[0])
        assert np.array_equal(norm_codes.sums.host, q.reshape(-1, 64).sum(-1))
        assert_codes(norm_codes.codes.host, q)
        assert_codes(codes.codes.host, quantize_activations(x)[0])
        # the attention values kernel, writing its per-head outputs' codes (o_lat for kv_b's value product)
        keys = 70
        scores_a, kv = mirror.of(rng.standard_normal(heads * keys)), mirror.of(rng.standard_normal(keys * n))
        o, value_codes = mirror(heads * n), mirror.codes(heads * n)
        scores = scores_a.host.reshape(heads, keys).copy()
        mirror.launch("mla_decode_values", (heads * k.red_lanes,), (k.red_lanes,), scores=scores_a.buffer,
                      kv_lat=kv.buffer, kv_lat_scale=kv.buffer, out=o.buffer, n=keys, n_total=keys, kvl=n, quantize=1,
                      **value_codes.buffers.args(),
                      keys=scores_a.buffer, use_keys=0)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        close(o.host.reshape(heads, n), (probs / probs.sum(-1, keepdims=True)) @ kv.host.reshape(keys, n), 1e-5)
        q, s = quantize_activations(o.host.reshape(heads, n))
        assert np.array_equal(value_codes.scales.host, s.reshape(-1))
        assert np.array_equal(value_codes.sums.host, q.reshape(-1, 64).sum(-1))
        assert_codes(value_codes.codes.host, q)


@pytest.mark.parametrize("bits", [3, 4, "nl4", 8])
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
    xa, y = mirror.of(x), mirror(heads * rows)
    codes, out = mirror.codes(heads * n), mirror.codes(heads * rows)
    cw = device_weight(kernels, w, unified=kernels.direct)
    for launch in (bind_quantize(kernels, xa.buffer, n, heads, codes.buffers),
                   bind_matvec_x8(kernels, cw, codes.buffers, y.buffer, heads, head_rows, 7, rows, out.buffers)):
        mirror.launch_bound(launch)
    close(y.host.reshape(heads, rows), want, 2e-6)
    q, s = quantize_activations(y.host[None])
    assert np.array_equal(out.scales.host, s[0]) and np.array_equal(out.sums.host, q.reshape(-1, 64).sum(-1))
    assert_codes(out.codes.host, q)


@pytest.mark.parametrize("bits", [3, 4, "nl4", 8])
def test_matvec_pair(kernels, wide_kernels, rng, bits):
    """mv2_*_x8: two products of one quantized input in one launch (the step's q_a and kv_a), odd row counts, each
    as mv_*_x8's."""
    n, rows, rows2 = 192, 37, 21
    w, w2 = make_weight(rng, rows, n, bits, 64)[0], make_weight(rng, rows2, n, bits, 64)[0]
    x = rng.standard_normal((1, n)).astype(np.float32)
    for k in (kernels, wide_kernels):
        mirror = Mirrors(k)
        xa, y, y2, codes = mirror.of(x), mirror(rows), mirror(rows2), mirror.codes(n)
        cw, cw2 = device_weight(k, w, unified=k.direct), device_weight(k, w2, unified=k.direct)
        for launch in (bind_quantize(k, xa.buffer, n, 1, codes.buffers),
                       bind_matvec_pair(k, cw, cw2, codes.buffers, y.buffer, y2.buffer)):
            mirror.launch_bound(launch)
        close(y.host, x8_linear(x, w)[0], 2e-6)
        close(y2.host, x8_linear(x, w2)[0], 2e-6)
