"""Symmetric integer quantization and bit packing of format v1 (DESIGN section 4).

A weight `W [O, I]` is quantized per row (`group_size=None`, scales `[O]`) or per group of
`group_size` input columns (scales `[O, ceil(I/g)]`, the last group may be partial):
`qmax = 2^(bits-1) - 1`, `q = clip(rint(w / s), -qmax-1, qmax)`, with the absmax scale `s = max(amax / qmax, 1e-8)`
unless the caller passes scales (the converter's `mse` quantizer searches them: glmkit/convert/quantizers.py).
Each row is packed on its own into `ceil(I * bits / 8)` bytes:
  int8: two's-complement bytes; int4: `q + 8`, the even column in the low nibble;
  int2: `q + 2`, column `4j + k` at bits `2k` of byte `j`.
"""

from __future__ import annotations

import numpy as np

SUPPORTED_BITS = (2, 4, 8)
MIN_SCALE = 1e-8
ROW_BLOCK_ELEMENTS = 1 << 22  # float32 temporaries of quantize(): 16 MB at a time


def qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def packed_row_bytes(in_features: int, bits: int) -> int:
    """Bytes one packed row of `in_features` values occupies."""
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


def quantize(w: np.ndarray, bits: int, group_size: int | None, scales: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """`w [O, I]` float -> (integer codes `[O, I]` int8, scales float32).

    `scales` may be given (a search picked them); otherwise absmax scales are used.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bit width {bits}")
    w = np.asarray(w, dtype=np.float32)
    out_features, in_features = w.shape
    top = qmax(bits)
    if scales is None:
        scales = absmax_scales(w, bits, group_size)
    codes = np.empty(w.shape, np.int8)
    for rows in _row_blocks(w.shape):  # temporaries stay at one block, not the whole matrix
        block = w[rows] / expand_scales(scales[rows], in_features, group_size)
        np.rint(block, out=block)
        np.clip(block, -top - 1, top, out=block)
        codes[rows] = block
    return codes, scales.astype(np.float32)


def _row_blocks(shape: tuple[int, int]) -> list[slice]:
    step = max(1, ROW_BLOCK_ELEMENTS // max(shape[1], 1))
    return [slice(r, r + step) for r in range(0, shape[0], step)]


def absmax_scales(w: np.ndarray, bits: int, group_size: int | None) -> np.ndarray:
    out_features, in_features = w.shape
    if group_size is None:
        amax = np.zeros(out_features, np.float32)
        if in_features:
            for rows in _row_blocks(w.shape):
                amax[rows] = np.abs(w[rows]).max(axis=1)
    else:
        groups = num_groups(in_features, group_size)
        amax = np.empty((out_features, groups), np.float32)
        for rows in _row_blocks(w.shape):
            padded = np.zeros((len(w[rows]), groups * group_size), np.float32)
            np.abs(w[rows], out=padded[:, :in_features])
            amax[rows] = padded.reshape(len(padded), groups, group_size).max(axis=2)
    return np.maximum(amax.astype(np.float32) / qmax(bits), np.float32(MIN_SCALE)).astype(np.float32)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Integer codes `[O, I]` (int8 in range) -> packed bytes `[O, ceil(I*bits/8)]` uint8."""
    out_features, in_features = codes.shape
    if bits == 8:
        return codes.astype(np.int8).view(np.uint8).copy()
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
    per_byte = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    lanes = np.empty((packed.shape[0], packed.shape[1], per_byte), np.int8)
    for k in range(per_byte):
        lanes[:, :, k] = ((packed >> np.uint8(bits * k)) & mask).astype(np.int8)
    lanes -= np.int8(1 << (bits - 1))
    return lanes.reshape(packed.shape[0], -1)[:, :in_features]


def dequantize(packed: np.ndarray, scales: np.ndarray, bits: int, group_size: int | None,
               in_features: int) -> np.ndarray:
    """Packed weight + scales -> float32 `[O, I]`."""
    codes = unpack(packed, bits, in_features).astype(np.float32)
    return codes * expand_scales(scales, in_features, group_size)
