"""Symmetric integer quantization and bit packing of format v1 (DESIGN section 4).

A weight `W [O, I]` is quantized per row (`group_size=None`, scales `[O]`) or per group of
`group_size` input columns (scales `[O, ceil(I/g)]`, the last group may be partial):
`qmax = 2^(bits-1) - 1`, `q = clip(rint(w / s), -qmax-1, qmax)`, with the absmax scale `s = max(amax / qmax, 1e-8)`
unless the caller passes scales (the converter's `mse` quantizer searches them: glmkit/convert/quantizers.py).
Each row is packed on its own into `ceil(I * bits / 8)` bytes:
  int8: two's-complement bytes; int4: `q + 8`, the even column in the low nibble;
  int2: `q + 2`, column `4j + k` at bits `2k` of byte `j`.
int3 packs `u = q + 4` in blocks of 64 columns, 24 bytes each (`24 * ceil(I / 64)` bytes a row, the last block's
missing columns stored as `u = 4`, code 0): block column `16k + j` (k < 4, j < 16) has its low two bits at bits
`2k, 2k+1` of block byte `j`, and column `8k + j` (k < 8, j < 8) its high bit at bit `k` of block byte `16 + j`.
Both planes unpack with whole-vector shifts and masks (kernels/common.cl), as llama.cpp's Q3_K does.

Scheme `nl4` (4 bits only) stores its codes exactly as int4 (`u = q + 8` per nibble) but a code stands for the level
`NL4_LEVELS[u]` instead of `q`: `w ~= s * NL4_LEVELS[q + 8]`, a fixed non-uniform table, denser near 0 (IQ4_NL's).
Its scales may be negative, and a group of zeros has scale 0 (no level is 0).
The levels are small integers, so products with int8 activations stay integer sums (kernels/common.cl).
"""

from __future__ import annotations

import numpy as np

SUPPORTED_BITS = (2, 3, 4, 8)
SCHEMES = ("symmetric", "nl4")  # the manifest's quant schemes: uniform codes, or nl4's table of levels
# nl4's 16 levels, index u = stored nibble (llama.cpp's kvalues_iq4nl): |level| <= 127, so levels fit int8
NL4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
NL4_TOP = 127  # the largest |level|: nl4's absmax scale maps the group's largest |w| onto level -127
# The midpoints between nl4's levels are multiples of 1/2, so the level nearest v is constant on [k/2, (k+1)/2):
# a lookup by floor(2 v) (ties go to the upper level). The code of half-step k + 256, and its level as float32:
NL4_HALF_CODES = (np.searchsorted((NL4_LEVELS[1:].astype(np.float64) + NL4_LEVELS[:-1]) / 2,
                                  np.arange(-256, 256) / 2, side="right") - 8).astype(np.int8)
NL4_HALF_VALUES = NL4_LEVELS.astype(np.float32)[NL4_HALF_CODES.astype(np.intp) + 8]
INT3_BLOCK = 64  # columns of one int3 storage block
INT3_BLOCK_BYTES = 24  # its 16 bytes of low bit pairs, then 8 bytes of high bits
MIN_SCALE = 1e-8
ROW_BLOCK_ELEMENTS = 1 << 22  # float32 temporaries of quantize(): 16 MB at a time


def qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def check_scheme(scheme: str, bits: int) -> None:
    """ValueError unless `scheme` is known and defined for `bits`."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quant scheme {scheme!r} (known: {', '.join(SCHEMES)})")
    if scheme == "nl4" and bits != 4:
        raise ValueError(f"quant scheme 'nl4' is 4-bit only, not {bits}-bit")


def nl4_half_steps(v: np.ndarray) -> np.ndarray:
    """Values in units of the scale `[...]` (float32, overwritten) -> their index into NL4_HALF_CODES/_VALUES
    (`floor(2 v) + 256`, clipped to the table)."""
    np.multiply(v, np.float32(2), out=v)
    np.add(v, np.float32(256), out=v)
    np.nan_to_num(v, copy=False, nan=256.0)  # NaN (a zero group's 0 / 0, or a NaN weight): v = 0
    np.clip(v, 0, 511, out=v)
    return v.astype(np.intp)  # truncation: the floor of a value >= 0


def nl4_codes(v: np.ndarray) -> np.ndarray:
    """Values in units of the scale `[...]` -> the codes (`u - 8`, int8) of their nearest nl4 levels."""
    return np.take(NL4_HALF_CODES, nl4_half_steps(np.array(v, np.float32)))


def signed_peaks(g: np.ndarray) -> np.ndarray:
    """The signed value of the largest |w| along the last axis of `g [..., n]` (the positive one on a tie)."""
    top, bottom = g.max(axis=-1), g.min(axis=-1)
    return np.where(top >= -bottom, top, bottom)


def code_values(codes: np.ndarray, scheme: str) -> np.ndarray:
    """Codes `[...]` -> the values they stand for (before the scale) as float32: the code itself, or nl4's level."""
    if scheme == "nl4":
        return NL4_LEVELS.astype(np.float32)[codes.astype(np.intp) + 8]
    return codes.astype(np.float32)


def packed_row_bytes(in_features: int, bits: int) -> int:
    """Bytes one packed row of `in_features` values occupies."""
    if bits == 3:
        return -(-in_features // INT3_BLOCK) * INT3_BLOCK_BYTES
    return (in_features * bits + 7) // 8


def num_groups(in_features: int, group_size: int | None) -> int:
    return 1 if group_size is None else -(-in_features // group_size)


def scales_shape(shape: tuple[int, int], group_size: int | None) -> tuple[int, ...]:
    out_features, in_features = shape
    return (out_features,) if group_size is None else (out_features, num_groups(in_features, group_size))


def expand_scales(scales: np.ndarray, in_features: int, group_size: int | None) -> np.ndarray:
    """Scales `[O]` or `[O, G]` -> one scale per element `[O, I]` (float32)."""
    if group_size is None:
        return np.broadcast_to(scales[:, None], (scales.shape[0], in_features))
    return np.repeat(scales, group_size, axis=1)[:, :in_features]


def quantize(w: np.ndarray, bits: int, group_size: int | None, scales: np.ndarray | None = None,
             scheme: str = "symmetric") -> tuple[np.ndarray, np.ndarray]:
    """`w [O, I]` float -> (integer codes `[O, I]` int8, scales float32): each code the nearest of the scheme's.

    `scales` may be given (a search picked them); otherwise absmax scales are used.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bit width {bits}")
    check_scheme(scheme, bits)
    w = np.asarray(w, dtype=np.float32)
    out_features, in_features = w.shape
    top = qmax(bits)
    if scales is None:
        scales = absmax_scales(w, bits, group_size, scheme)
    codes = np.empty(w.shape, np.int8)
    for rows in _row_blocks(w.shape):  # temporaries stay at one block, not the whole matrix
        with np.errstate(divide="ignore", invalid="ignore"):  # nl4: a group of zeros has scale 0
            block = w[rows] / expand_scales(scales[rows], in_features, group_size)
        if scheme == "nl4":
            codes[rows] = np.take(NL4_HALF_CODES, nl4_half_steps(block))
            continue
        np.rint(block, out=block)
        np.clip(block, -top - 1, top, out=block)
        codes[rows] = block
    return codes, scales.astype(np.float32)


def _row_blocks(shape: tuple[int, int]) -> list[slice]:
    step = max(1, ROW_BLOCK_ELEMENTS // max(shape[1], 1))
    return [slice(r, r + step) for r in range(0, shape[0], step)]


def absmax_scales(w: np.ndarray, bits: int, group_size: int | None, scheme: str = "symmetric") -> np.ndarray:
    """Scales `[O]` or `[O, G]` mapping each row's or group's largest |w| onto the largest code: `amax / qmax`, or
    for nl4 `-m / 127` with m that largest weight's signed value (it lands on level -127, its sign flipped by a
    negative scale: the table's longer side, as llama.cpp's IQ4_NL), not floored (a group of zeros gets scale 0:
    the table has no level 0, and a floor would turn tiny weights into larger ones); symmetric |s| >= MIN_SCALE."""
    out_features, in_features = w.shape
    groups = num_groups(in_features, group_size)
    width = groups * (in_features if group_size is None else group_size)
    peak = np.zeros((out_features, groups), np.float32)  # nl4: the signed weight of largest |w|; else amax
    if in_features:
        for rows in _row_blocks(w.shape):
            padded = np.zeros((len(w[rows]), width), np.float32)
            if scheme == "nl4":
                padded[:, :in_features] = w[rows]
                peak[rows] = signed_peaks(padded.reshape(len(padded), groups, -1))
            else:
                np.abs(w[rows], out=padded[:, :in_features])
                peak[rows] = padded.reshape(len(padded), groups, -1).max(axis=2)
    if scheme == "nl4":
        s = np.where(peak == 0, np.float32(0), -peak / np.float32(NL4_TOP)).astype(np.float32)
    else:
        s = np.maximum(peak / np.float32(qmax(bits)), np.float32(MIN_SCALE)).astype(np.float32)
    return s[:, 0].copy() if group_size is None else s


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Integer codes `[O, I]` (int8 in range) -> packed bytes `[O, ceil(I*bits/8)]` uint8."""
    out_features, in_features = codes.shape
    if bits == 8:
        return codes.astype(np.int8).view(np.uint8).copy()
    if bits == 3:
        return _pack_int3(codes)
    per_byte = 8 // bits
    padded_len = packed_row_bytes(in_features, bits) * per_byte
    biased = np.zeros((out_features, padded_len), np.uint8)
    biased[:, :in_features] = (codes.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8)
    lanes = biased.reshape(out_features, -1, per_byte)
    packed = np.zeros(lanes.shape[:2], np.uint8)
    for k in range(per_byte):
        packed |= lanes[:, :, k] << np.uint8(bits * k)
    return packed


def unpack(packed: np.ndarray, bits: int, in_features: int) -> np.ndarray:
    """Packed bytes `[O, B]` -> integer codes `[O, in_features]` int8 (exact inverse of `pack`)."""
    if bits == 8:
        return packed.view(np.int8)[:, :in_features]
    if bits == 3:
        return _unpack_int3(packed, in_features)
    per_byte = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    lanes = np.empty((packed.shape[0], packed.shape[1], per_byte), np.int8)
    for k in range(per_byte):
        lanes[:, :, k] = ((packed >> np.uint8(bits * k)) & mask).astype(np.int8)
    lanes -= np.int8(1 << (bits - 1))
    return lanes.reshape(packed.shape[0], -1)[:, :in_features]


def _pack_int3(codes: np.ndarray) -> np.ndarray:
    """int3 codes `[O, I]` -> `[O, 24 * ceil(I / 64)]` bytes (the block layout in the module docstring)."""
    out_features, in_features = codes.shape
    blocks = -(-in_features // INT3_BLOCK)
    u = np.full((out_features, blocks * INT3_BLOCK), 4, np.uint8)
    u[:, :in_features] = (codes.astype(np.int16) + 4).astype(np.uint8)
    u = u.reshape(out_features, blocks, INT3_BLOCK)
    low = (u & 3).reshape(out_features, blocks, 4, 16)  # [.., k, j]: column 16k + j
    high = (u >> 2).reshape(out_features, blocks, 8, 8)  # [.., k, j]: column 8k + j
    packed = np.zeros((out_features, blocks, INT3_BLOCK_BYTES), np.uint8)
    for k in range(4):
        packed[:, :, :16] |= low[:, :, k] << np.uint8(2 * k)
    for k in range(8):
        packed[:, :, 16:] |= high[:, :, k] << np.uint8(k)
    return packed.reshape(out_features, blocks * INT3_BLOCK_BYTES)


def _unpack_int3(packed: np.ndarray, in_features: int) -> np.ndarray:
    """Inverse of `_pack_int3`: bytes `[O, 24 * blocks]` -> int8 codes `[O, in_features]`."""
    out_features, row_bytes = packed.shape
    blocks = row_bytes // INT3_BLOCK_BYTES
    if row_bytes % INT3_BLOCK_BYTES or blocks * INT3_BLOCK < in_features:
        raise ValueError(f"int3 rows of {row_bytes} bytes cannot hold {in_features} columns: expected "
                         f"{packed_row_bytes(in_features, 3)} (24 bytes per 64 columns)")
    b = packed.reshape(out_features, blocks, INT3_BLOCK_BYTES)
    low = np.stack([(b[:, :, :16] >> np.uint8(2 * k)) & 3 for k in range(4)], axis=2)  # [.., k, j]
    high = np.stack([(b[:, :, 16:] >> np.uint8(k)) & 1 for k in range(8)], axis=2)
    u = low.reshape(out_features, blocks, INT3_BLOCK) | (high.reshape(out_features, blocks, INT3_BLOCK) << 2)
    codes = u.astype(np.int8) - np.int8(4)
    return codes.reshape(out_features, blocks * INT3_BLOCK)[:, :in_features]


def dequantize(packed: np.ndarray, scales: np.ndarray, bits: int, group_size: int | None,
               in_features: int, scheme: str = "symmetric") -> np.ndarray:
    """Packed weight + scales -> float32 `[O, I]`."""
    codes = code_values(unpack(packed, bits, in_features), scheme)
    return codes * expand_scales(scales, in_features, group_size)
