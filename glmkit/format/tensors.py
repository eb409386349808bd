"""In-memory views of container tensors that the runtime computes with."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from glmkit.format.packing import dequantize


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A quantized 2-D weight `[O, I]`, viewed in place from the container.

    packed: uint8 `[O, ceil(I*bits/8)]`; scales: float32 `[O]` (per row) or `[O, ceil(I/group_size)]`;
    scheme: the manifest's quant scheme ("symmetric", or "nl4": codes looked up in packing.NL4_LEVELS).
    """

    packed: np.ndarray
    scales: np.ndarray
    bits: int
    group_size: int | None
    shape: tuple[int, int]
    scheme: str = "symmetric"

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes

    def dequantize(self) -> np.ndarray:
        """float32 `[O, I]` (a fresh array)."""
        return dequantize(self.packed, self.scales, self.bits, self.group_size, self.shape[1], self.scheme)


Weight = np.ndarray | QuantWeight
