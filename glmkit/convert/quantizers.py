"""Choosing the scales of format v1's quantization (the codes are always the nearest of the scheme's values to
`w / s`: `clip(rint(w / s))` for the uniform `symmetric` scheme, the nearest level of nl4's table for `nl4`).

- `absmax`: `s = max(amax / qmax, 1e-8)` per row or group (DESIGN section 4).
- `mse`: per row or group, the scale that minimises the weighted squared error
  `sum_j e_j (w_j - s q_j)^2` with `q = clip(rint(w / s), -qmax-1, qmax)`, found by a search: for each
  candidate `s_c = amax / (qmax f)` on a fixed grid of `f >= 1` (`f > 1` clips the largest values; it also
  reaches the extra negative code `-qmax-1` that absmax leaves unused), round, refit the least-squares scale
  for those codes (`s' = sum e w q / sum e q^2`), round again with `s'` and keep the best. Rounding to the
  nearest code is optimal for a fixed scale and the refit is optimal for fixed codes, so each candidate ends
  no worse than where it started; absmax is the first candidate, so the result is never worse than absmax.
  Vectorised NumPy over blocks of rows (threads over blocks), deterministic.
  nl4 the same over its table's levels (`q` = the level nearest `w / s`): the table is lopsided (-127 .. 113), so
  the candidates put m, the group's signed largest weight, near either end: `s_c = -m / (127 f)` and
  `s_c = m / (113 f)` (a scale's sign is free), for 6 factors f in 0.9 .. 1.3 each; absmax (`-m / 127`) is kept
  unless a candidate beats it, and a refitted scale keeps whatever sign it gets. nl4 scales are not floored: a group
  of zeros gets scale 0 (exact zeros: the table has no level 0).

Element weights `e_j = a_j sqrt(sigma^2 + w_j^2)` (`sigma^2` = the group's mean `w^2`): large weights count
more, as in llama.cpp's quantizers (docs/QUALITY.md). `a` (importance
per input column, `[I]`) is 1 by default; with an imatrix (`glm-calibrate`) it is the mean square of that
column's input activation (normalised to mean 1), so the columns the model actually drives get the accuracy:
for `y = x W^T` the expected output error is `sum_j E[x_j^2] dW_j^2` when inputs are uncorrelated.

- `gptq`: inputs are correlated, and the output error of a whole row is `dw H dw^T` with `H = E[x x^T]`
  (the calibration Hessian, `glm-calibrate`). GPTQ (Frantar et al. 2022) quantizes the columns in order and
  after each one moves its rounding error onto the columns not yet quantized, along `H^-1` (the optimal
  correction for that error), so later columns absorb what earlier ones lost. Each group's scale is the
  `mse` search over the group's weights as they stand when the group is reached (per row: over the original
  row, importance = `diag H`), each column's codes the scheme's nearest. Codes and scales are format v1's; only
  which codes are chosen differs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from threadpoolctl import threadpool_limits

from glmkit.format.packing import (
    MIN_SCALE,
    NL4_HALF_VALUES,
    NL4_TOP,
    absmax_scales,
    check_scheme,
    code_values,
    expand_scales,
    nl4_codes,
    num_groups,
    qmax,
    scales_shape,
    signed_peaks,
)

QUANTIZERS = ("absmax", "mse", "gptq")
_Block = TypeVar("_Block")
# Candidate clip factors f (scale = amax / (qmax f)); low bit widths gain from clipping far more.
_GRIDS = {
    8: np.linspace(1.0, 1.5, 8),
    4: np.linspace(1.0, 2.0, 16),
    3: np.linspace(1.0, 2.5, 16),
    2: np.linspace(1.0, 3.5, 16),
}
_NL4_GRID = [np.float32(end * f) for end in (NL4_TOP, -113) for f in np.linspace(0.9, 1.3, 6)]  # scale = -m / g
_BLOCK_ELEMS = 1 << 18  # elements of one row block (the search's working set stays in cache)
IMPORTANCE_FLOOR = 1e-3  # relative to the mean: a column never seen in calibration still counts a little


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def choose_scales(w: np.ndarray, bits: int, group_size: int | None, quantizer: str,
                  importance: np.ndarray | None = None, threads: int | None = None,
                  scheme: str = "symmetric") -> np.ndarray:
    """Scales for `w [O, I]` (`[O]` per row, `[O, ceil(I/g)]` grouped) by the named quantizer."""
    check_scheme(scheme, bits)
    if quantizer == "absmax":
        return absmax_scales(np.asarray(w, np.float32), bits, group_size, scheme)
    if quantizer in ("mse", "gptq"):  # gptq without a Hessian for this weight falls back to the search
        return search_scales(w, bits, group_size, importance, threads, scheme)
    raise ValueError(f"unknown quantizer {quantizer!r}")


def normalized_importance(values: np.ndarray) -> np.ndarray:
    """Per-column weights from raw activation energies: mean 1, floored at IMPORTANCE_FLOOR."""
    a = np.asarray(values, np.float64)
    mean = a.mean() if a.size else 0.0
    if not np.isfinite(mean) or mean <= 0:
        return np.ones(a.shape, np.float32)
    return np.maximum(a / mean, IMPORTANCE_FLOOR).astype(np.float32)


def search_scales(w: np.ndarray, bits: int, group_size: int | None, importance: np.ndarray | None = None,
                  threads: int | None = None, scheme: str = "symmetric") -> np.ndarray:
    """The `mse` quantizer's scales (see the module docstring); same shape as `absmax_scales`."""
    w = np.asarray(w, np.float32)
    out_features, in_features = w.shape
    group = in_features if group_size is None else group_size
    groups = num_groups(in_features, group_size)
    width = groups * group
    a = _padded_importance(importance, in_features, width)
    scales = np.empty((out_features, groups), np.float32)
    rows = max(1, _BLOCK_ELEMS // max(width, 1))
    blocks = [(r, min(out_features, r + rows)) for r in range(0, out_features, rows)]

    def run(block: tuple[int, int]) -> None:
        r0, r1 = block
        padded = np.zeros((r1 - r0, width), np.float32)
        padded[:, :in_features] = w[r0:r1]
        e = _element_weights(padded, a, group, in_features)
        search = _search_nl4 if scheme == "nl4" else _search_block
        best = search(padded.reshape(-1, group), e, bits)
        scales[r0:r1] = best.reshape(r1 - r0, groups)

    run_blocks(run, blocks, threads)
    return scales[:, 0].copy() if group_size is None else scales


def run_blocks(run: Callable[[_Block], None], blocks: list[_Block], threads: int | None) -> None:
    """`run` every row block, on up to `threads` threads (default: default_threads())."""
    workers = min(threads or default_threads(), len(blocks))
    if workers <= 1:
        for b in blocks:
            run(b)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(run, blocks))


def _padded_importance(importance: np.ndarray | None, in_features: int, width: int) -> np.ndarray | None:
    if importance is None:
        return None
    if np.asarray(importance).shape != (in_features,):
        raise ValueError(f"importance has shape {np.asarray(importance).shape}, expected ({in_features},)")
    a = np.zeros(width, np.float32)
    a[:in_features] = importance  # zero on the padding of a partial last group
    return a


def _element_weights(padded: np.ndarray, a: np.ndarray | None, group: int, in_features: int) -> np.ndarray:
    """`e = a_j sqrt(sigma^2 + w^2)` as `[rows x groups, g]` for zero-padded rows `[n, groups x g]`."""
    n, width = padded.shape
    groups = width // group
    w = padded.reshape(-1, group)
    counts = np.full(groups, group, np.float32)
    counts[-1] = in_features - (groups - 1) * group  # padding is 0: it adds nothing to the sum
    sq = w * w
    sigma2 = sq.sum(axis=1) / np.tile(counts, n)
    e = np.sqrt(sigma2[:, None] + sq)
    if a is not None:
        e *= np.broadcast_to(a, padded.shape).reshape(-1, group)
    return e


def _search_block(w: np.ndarray, a: np.ndarray | None, bits: int) -> np.ndarray:
    """w `[m, g]` (m = rows x groups, zero-padded), element weights a `[m, g]` (None: 1) -> best scales `[m]`.

    A candidate is ranked by the error of its codes at the refitted scale, `sum a w^2 - num^2 / den`
    (closed form, no extra pass); re-rounding at that scale, as the stored codes are, can only lower it.
    Everything is 2-D `[m, g]`: NumPy's row-wise `einsum("ij,ij->i")` and row broadcasts are fastest there.
    """
    top = qmax(bits)
    lo, hi = np.float32(-top - 1), np.float32(top)
    amax = np.abs(w).max(axis=1)
    absmax = np.maximum(amax / np.float32(top), np.float32(MIN_SCALE))
    aw = w if a is None else a * w
    energy = np.einsum("ij,ij->i", aw, w)
    best_s = absmax
    best_err = np.full(amax.shape, np.inf, np.float32)
    q = np.empty_like(w)
    aq = None if a is None else np.empty_like(w)
    for f in _GRIDS[bits]:
        s = np.maximum(amax / np.float32(top * f), np.float32(MIN_SCALE))
        np.multiply(w, (np.float32(1) / s)[:, None], out=q)
        np.rint(q, out=q)
        np.clip(q, lo, hi, out=q)
        num = np.einsum("ij,ij->i", q, aw)
        if aq is None:
            den = np.einsum("ij,ij->i", q, q)
        else:
            den = np.einsum("ij,ij->i", np.multiply(q, a, out=aq), q)
        ok = (den > 0) & (num > 0)
        safe_den = np.where(ok, den, np.float32(1))
        err = np.where(ok, energy - num * num / safe_den, energy)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_s = np.where(better, np.maximum(np.where(ok, num / safe_den, s), np.float32(MIN_SCALE)), best_s)
    # float32 sums can misorder near-equal errors: the final word is float64, as in `weighted_error`
    keep = _error64(w, a, best_s, "symmetric", bits) <= _error64(w, a, absmax, "symmetric", bits)
    return np.where(keep, best_s, absmax).astype(np.float32)


def _search_nl4(w: np.ndarray, a: np.ndarray | None, bits: int) -> np.ndarray:
    """`_search_block` over nl4's levels: w `[m, g]`, element weights a `[m, g]` (None: 1) -> best scales `[m]`,
    signed (see the module docstring)."""
    peak = signed_peaks(w)
    absmax = np.where(peak == 0, np.float32(0), -peak / np.float32(NL4_TOP)).astype(np.float32)  # absmax_scales's
    aw = w if a is None else a * w
    energy = np.einsum("ij,ij->i", aw, w)
    best_s = absmax
    best_err = np.full(len(w), np.inf, np.float32)
    q = np.empty_like(w)
    aq = None if a is None else np.empty_like(w)
    with np.errstate(divide="ignore", invalid="ignore"):  # a group of zeros: s = 0, w / s = nan (code irrelevant)
        for g in _NL4_GRID:
            s = (-peak / g).astype(np.float32)
            # nl4_half_steps in two passes: truncation floors q >= 0, and take's clip sends q < 0 (w / s < -128) to
            # index 0 (level -127) and q >= 512 to 511 (level 113), where the floor's index would be clipped too
            np.multiply(w, (np.float32(2) / s)[:, None], out=q)
            np.add(q, np.float32(256), out=q)
            np.take(NL4_HALF_VALUES, q.astype(np.intp), out=q, mode="clip")
            num = np.einsum("ij,ij->i", q, aw)
            if aq is None:
                den = np.einsum("ij,ij->i", q, q)
            else:
                den = np.einsum("ij,ij->i", np.multiply(q, a, out=aq), q)
            ok = (den > 0) & (num != 0)
            safe_den = np.where(ok, den, np.float32(1))
            err = np.where(ok, energy - num * num / safe_den, energy)
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_s = np.where(better, np.where(ok, num / safe_den, s), best_s)
    keep = _error64(w, a, best_s, "nl4", 4) <= _error64(w, a, absmax, "nl4", 4)
    return np.where(peak == 0, np.float32(0), np.where(keep, best_s, absmax)).astype(np.float32)  # zeros: scale 0


def _nearest_values(v: np.ndarray, scheme: str, bits: int) -> np.ndarray:
    """The scheme's nearest value (before the scale) to each of `v` (in units of the scale), as float32."""
    if scheme == "nl4":
        return code_values(nl4_codes(v), scheme)
    top = qmax(bits)
    return np.clip(np.rint(v), -top - 1, top).astype(np.float32)


def _error64(w: np.ndarray, a: np.ndarray | None, s: np.ndarray, scheme: str, bits: int) -> np.ndarray:
    """Per row `sum a (w - q s)^2` in float64, the reconstruction `q s` in float32 as the runtime computes it."""
    with np.errstate(divide="ignore", invalid="ignore"):  # nl4: a group of zeros has scale 0
        q = _nearest_values(w / s[:, None], scheme, bits)
    diff = w.astype(np.float64) - q * s[:, None]
    return np.einsum("ij,ij->i", diff if a is None else a * diff, diff)


def weighted_error(w: np.ndarray, scales: np.ndarray, bits: int, group_size: int | None,
                   importance: np.ndarray | None = None, scheme: str = "symmetric") -> float:
    """The `mse` objective `sum e (w - s q)^2` of quantizing `w` with these scales (codes re-derived from them)."""
    w = np.asarray(w, np.float32)
    out_features, in_features = w.shape
    group = in_features if group_size is None else group_size
    width = num_groups(in_features, group_size) * group
    padded = np.zeros((out_features, width), np.float32)
    padded[:, :in_features] = w
    e = _element_weights(padded, _padded_importance(importance, in_features, width), group, in_features)
    full = expand_scales(scales, in_features, group_size)
    with np.errstate(divide="ignore", invalid="ignore"):  # nl4: a group of zeros has scale 0
        q = _nearest_values(w / full, scheme, bits)
    diff = np.zeros((out_features, width), np.float64)
    diff[:, :in_features] = w.astype(np.float64) - q * full
    return float((e.reshape(out_features, width) * diff * diff).sum())


GPTQ_DAMPING = 0.01  # added to H's diagonal, relative to its mean: keeps H invertible, as in the GPTQ paper
GPTQ_BLOCK = 128  # columns corrected eagerly; the rest of the matrix is updated once per block (one GEMM)
GPTQ_BLOCK_ELEMS = 1 << 24  # largest row block (64 MB of float32 working copy)
GPTQ_ROWS = 256  # rows of one block: the per-column loop costs about the same for 1 row or 256
BLAS_THREADS_FROM = 1024  # Hessians this wide are factored with OpenBLAS's threads; smaller ones lose by them


@dataclass(frozen=True)
class HessianFactor:
    """What GPTQ needs of a Hessian `H [I, I]`, computed once per distinct input (weights sharing an input
    share it): `upper`, the upper Cholesky factor of `H^-1` (`H^-1 = U^T U`), and the per-column importance
    (`diag H`, normalised) for the scale search."""

    upper: np.ndarray  # [I, I] float32
    importance: np.ndarray  # [I] float32

    @classmethod
    def from_hessian(cls, hessian: np.ndarray) -> HessianFactor:
        """Damped and with dead columns fixed: a column no calibration input ever reached (`H_jj = 0`) gets a
        unit diagonal, so it is rounded like any other and passes no error on (no evidence how it interacts)."""
        h = np.array(hessian, np.float64)
        if h.ndim != 2 or h.shape[0] != h.shape[1]:
            raise ValueError(f"Hessian has shape {h.shape}, expected a square matrix")
        if not np.isfinite(h).all():
            raise ValueError("Hessian holds non-finite values")
        diag = np.diag(h).copy()
        mean = diag[diag > 0].mean() if (diag > 0).any() else 1.0
        dead = diag <= 0
        h[dead, :] = 0.0
        h[:, dead] = 0.0
        h[np.diag_indices_from(h)] = np.where(dead, mean, diag) + GPTQ_DAMPING * mean
        with threadpool_limits(1 if len(h) < BLAS_THREADS_FROM else None, user_api="blas"):
            inverse = np.linalg.inv(h)
            upper = np.linalg.cholesky((inverse + inverse.T) / 2).T.astype(np.float32)
        return cls(upper, normalized_importance(diag))


def gptq_quantize(w: np.ndarray, factor: HessianFactor, bits: int, group_size: int | None,
                  threads: int | None = None, scheme: str = "symmetric") -> tuple[np.ndarray, np.ndarray]:
    """GPTQ codes and scales for `w [O, I]` given its inputs' `HessianFactor` (`I` columns).

    Returns (codes int8 `[O, I]`, scales float32 `[O]` or `[O, G]`), exactly what `packing.quantize` returns.
    Rows are independent given `H`, so they run in blocks (bounded memory, threads), deterministically.
    """
    check_scheme(scheme, bits)
    w = np.asarray(w, np.float32)
    out_features, in_features = w.shape
    if factor.upper.shape != (in_features, in_features):
        raise ValueError(f"Hessian has shape {factor.upper.shape}, expected ({in_features}, {in_features})")
    codes = np.empty(w.shape, np.int8)
    scales = np.empty(scales_shape(w.shape, group_size), np.float32)
    workers = threads or default_threads()
    # row blocks of a size fixed by the shape alone: a BLAS product's rounding may depend on its row count, so a
    # split that followed the thread count would make the codes depend on it
    rows = max(1, min(GPTQ_ROWS, GPTQ_BLOCK_ELEMS // max(in_features, 1)))
    blocks = [slice(r, min(out_features, r + rows)) for r in range(0, out_features, rows)]

    def run(block: slice) -> None:
        codes[block], scales[block] = _gptq_rows(w[block], factor.upper, factor.importance, bits, group_size,
                                                 scheme)

    with threadpool_limits(1, user_api="blas"):  # the row blocks are the parallelism
        run_blocks(run, blocks, workers)
    return codes, scales


def _gptq_rows(w: np.ndarray, upper: np.ndarray, importance: np.ndarray, bits: int,
               group_size: int | None, scheme: str) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ over a block of rows `w [n, I]` with the upper inverse-Cholesky factor `[I, I]`."""
    n, in_features = w.shape
    top = qmax(bits)
    lo, hi = np.float32(-top - 1), np.float32(top)
    work = w.T.copy()  # [I, n]: the algorithm walks columns, which are then contiguous rows
    codes = np.empty((in_features, n), np.int8)
    scales = np.empty(scales_shape((n, in_features), group_size), np.float32)
    if group_size is None:
        scales[:] = search_scales(w, bits, None, importance, threads=1, scheme=scheme)
    for b0 in range(0, in_features, GPTQ_BLOCK):
        b1 = min(in_features, b0 + GPTQ_BLOCK)
        errors = np.empty((b1 - b0, n), np.float32)
        for j in range(b0, b1):
            if group_size is None:
                s = scales
            else:
                g, start = divmod(j, group_size)
                if start == 0:  # entering a group: its scale from the weights as corrected so far
                    end = min(in_features, j + group_size)
                    scales[:, g] = search_scales(work[j:end].T, bits, end - j, importance[j:end], threads=1,
                                                 scheme=scheme)[:, 0]
                s = scales[:, g]
            if scheme == "nl4":
                with np.errstate(divide="ignore", invalid="ignore"):  # a group of zeros has scale 0
                    codes[j] = nl4_codes(work[j] / s)
                q = code_values(codes[j], scheme)
            else:
                q = np.clip(np.rint(work[j] / s), lo, hi)
                codes[j] = q
            err = (work[j] - q * s) / upper[j, j]
            work[j + 1:b1] -= np.outer(upper[j, j + 1:b1], err)
            errors[j - b0] = err
        # [n, rest] as before the transpose: the GEMM vectorises along `rest` whatever the block's row count n,
        # so the result does not depend on how rows were split over threads
        work[b1:] -= (errors.T @ upper[b0:b1, b1:]).T
    return codes.T, scales
