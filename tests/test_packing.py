import ml_dtypes
import numpy as np
import pytest

from glmkit.convert.sources.snapshot import dequantize_fp8_blocks
from glmkit.errors import GlmkitError
from glmkit.format.packing import NL4_LEVELS, code_values, dequantize, pack, packed_row_bytes, qmax, quantize, unpack


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("in_features", [1, 3, 7, 64, 130])
def test_pack_unpack_round_trip(bits, in_features):
    rng = np.random.default_rng(bits * 1000 + in_features)
    codes = rng.integers(-qmax(bits) - 1, qmax(bits) + 1, size=(5, in_features)).astype(np.int8)
    packed = pack(codes, bits)
    assert packed.dtype == np.uint8 and packed.shape == (5, packed_row_bytes(in_features, bits))
    np.testing.assert_array_equal(unpack(packed, bits, in_features), codes)


def test_int4_layout_low_nibble_is_even_index():
    packed = pack(np.array([[-8, 7, 0, -1]], np.int8), 4)
    assert packed.tolist() == [[0x0 | (0xF << 4), 0x8 | (0x7 << 4)]]


def test_int2_layout_element_k_at_bits_2k():
    packed = pack(np.array([[-2, -1, 0, 1, 1]], np.int8), 2)
    assert packed.tolist() == [[0 | 1 << 2 | 2 << 4 | 3 << 6, 3]]


def test_int3_layout_blocks_of_64_in_24_bytes():
    """Column 16k + j: bits 2k..2k+1 of byte j; column 8k + j: bit k of byte 16 + j (values code + 4); a partial
    block is padded with code 0 (value 4: low bits 0, high bit 1)."""
    codes = np.zeros((1, 70), np.int8)  # value 4 everywhere: low pair 00, high bit 1
    codes[0, 0] = 3  # value 7: low 11 at bits 0-1 of byte 0, high bit at bit 0 of byte 16
    codes[0, 17] = -4  # value 0: column 16 * 1 + 1 -> bits 2-3 of byte 1; column 8 * 2 + 1 -> bit 2 of byte 17
    codes[0, 63] = -1  # value 3: column 16 * 3 + 15 -> bits 6-7 of byte 15; column 8 * 7 + 7 -> bit 7 of byte 23
    packed = pack(codes, 3)
    assert packed.shape == (1, 48) and packed_row_bytes(70, 3) == 48 and packed_row_bytes(128, 3) == 48
    want = [0] * 16 + [0xFF] * 8 + [0] * 16 + [0xFF] * 8
    want[0], want[15] = 0b11, 0b11 << 6
    want[17], want[23] = 0xFF & ~(1 << 2), 0xFF & ~(1 << 7)
    assert packed[0].tolist() == want


def test_int3_unpack_refuses_rows_that_are_not_whole_blocks():
    with pytest.raises(ValueError, match="int3 rows of 36 bytes"):
        unpack(np.zeros((2, 36), np.uint8), 3, 96)
    with pytest.raises(ValueError, match="expected 48"):
        unpack(np.zeros((2, 24), np.uint8), 3, 96)


def test_int8_is_twos_complement():
    assert pack(np.array([[-128, -1, 0, 127]], np.int8), 8).tolist() == [[128, 255, 0, 127]]


@pytest.mark.parametrize("bits,group", [(8, None), (4, None), (4, 64), (4, 5), (3, 64), (3, 5), (2, 64), (2, 3)])
def test_values_on_the_grid_are_exact(bits, group):
    rng = np.random.default_rng(1)
    rows, cols = 6, 133
    ngroups = 1 if group is None else -(-cols // group)
    scales = rng.uniform(0.01, 2.0, size=(rows, ngroups)).astype(np.float32)
    # symmetric absmax never produces -qmax-1 (|w| <= amax), so the grid is [-qmax, qmax]
    codes = rng.integers(-qmax(bits), qmax(bits) + 1, size=(rows, cols)).astype(np.int8)
    # force each group's amax to hit qmax so absmax scaling recovers the scale exactly
    for g in range(ngroups):
        lo = 0 if group is None else g * group
        codes[:, lo] = qmax(bits)
    full = scales if group is None else np.repeat(scales, group, axis=1)[:, :cols]
    w = codes.astype(np.float32) * full
    got_codes, got_scales = quantize(w, bits, group)
    np.testing.assert_array_equal(got_codes, codes)
    np.testing.assert_allclose(dequantize(pack(got_codes, bits), got_scales, bits, group, cols), w, rtol=1e-6)


def test_quantize_error_is_at_most_half_a_step():
    w = np.random.default_rng(2).standard_normal((8, 200)).astype(np.float32)
    codes, scales = quantize(w, 4, 64)
    back = dequantize(pack(codes, 4), scales, 4, 64, 200)
    step = np.repeat(scales, 64, axis=1)[:, :200]
    assert np.all(np.abs(back - w) <= step / 2 + 1e-6)
    assert scales.shape == (8, 4)


def test_zero_rows_get_min_scale():
    codes, scales = quantize(np.zeros((2, 4), np.float32), 4, None)
    assert np.all(codes == 0) and np.all(scales == np.float32(1e-8))


def test_fp8_block_dequant_matches_ml_dtypes_with_partial_edge_blocks():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((200, 130)).astype(ml_dtypes.float8_e4m3fn)
    scales = rng.uniform(0.1, 3, size=(2, 2)).astype(np.float32)
    got = dequantize_fp8_blocks(w, scales)
    ref = w.astype(np.float32)
    ref[:128, :128] *= scales[0, 0]
    ref[:128, 128:] *= scales[0, 1]
    ref[128:, :128] *= scales[1, 0]
    ref[128:, 128:] *= scales[1, 1]
    np.testing.assert_array_equal(got, ref)
    with pytest.raises(GlmkitError, match="weight_scale_inv"):
        dequantize_fp8_blocks(w, scales[:1])


@pytest.mark.parametrize("bits,group", [(8, None), (4, 64), (2, 3)])
def test_row_blocked_quantization_equals_one_block(monkeypatch, bits, group):
    from glmkit.format import packing

    w = np.random.default_rng(4).standard_normal((37, 130)).astype(np.float32)
    whole = quantize(w, bits, group)
    monkeypatch.setattr(packing, "ROW_BLOCK_ELEMENTS", 3 * 130)  # 3 rows per block, a partial last block
    blocked = quantize(w, bits, group)
    np.testing.assert_array_equal(blocked[0], whole[0])
    np.testing.assert_array_equal(blocked[1], whole[1])


def test_nl4_codes_pack_as_int4_and_stand_for_the_table():
    """nl4 stores int4's bytes (nibble u = code + 8); code q stands for NL4_LEVELS[q + 8]: pack -> unpack is exact,
    and dequantize gives scale x level."""
    codes = np.arange(-8, 8, dtype=np.int8).reshape(1, 16).repeat(3, axis=0)
    codes[1] = codes[1][::-1]
    packed = pack(codes[:, :15], 4)  # an odd row: the last byte half used
    np.testing.assert_array_equal(unpack(packed, 4, 15), codes[:, :15])
    scales = np.array([[0.5], [-2.0], [1e-3]], np.float32)
    want = NL4_LEVELS.astype(np.float32)[codes[:, :15] + 8] * scales
    np.testing.assert_array_equal(dequantize(packed, scales, 4, 64, 15, "nl4"), want)
    np.testing.assert_array_equal(code_values(codes, "nl4")[0], NL4_LEVELS)
    assert NL4_LEVELS.tolist() == [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]


def test_nl4_quantize_picks_the_nearest_level():
    """Every code is the level nearest w / s (ties at a midpoint go to the upper level); values on the table are
    exact; absmax maps each group's largest |w| onto -127 (a negative scale where that weight is positive)."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((7, 150)).astype(np.float32)
    codes, scales = quantize(w, 4, 64, scheme="nl4")
    full = np.repeat(scales, 64, axis=1)[:, :150]
    levels = NL4_LEVELS.astype(np.float64)
    distance = np.abs((w / full)[..., None] - levels)  # [7, 150, 16]
    np.testing.assert_array_equal(distance[np.arange(7)[:, None], np.arange(150), codes + 8], distance.min(-1))
    peak = np.array([[row[np.abs(row).argmax()] for row in np.array_split(r, [64, 128])] for r in w])
    np.testing.assert_allclose(scales, -peak / 127, rtol=1e-6)
    on_table = levels[rng.integers(0, 16, size=(4, 64))].astype(np.float32) * np.float32(0.25)
    on_table[:, 0] = -127 * 0.25  # the absmax scale is then exactly 0.25
    got, s = quantize(on_table, 4, 64, scheme="nl4")
    np.testing.assert_array_equal(dequantize(pack(got, 4), s, 4, 64, 64, "nl4"), on_table)
    mids = (levels[1:] + levels[:-1]) / 2
    ties = quantize(np.array([mids], np.float32), 4, None, np.array([1.0], np.float32), "nl4")[0]
    np.testing.assert_array_equal(ties[0], np.arange(1, 16) - 8)


def test_nl4_is_4_bit_only():
    with pytest.raises(ValueError, match="4-bit only"):
        quantize(np.ones((1, 4), np.float32), 3, None, scheme="nl4")
    with pytest.raises(ValueError, match="unknown quant scheme 'nl3'"):
        quantize(np.ones((1, 4), np.float32), 4, None, scheme="nl3")
