#!/usr/bin/env python3
"""Compare code grids by simulation (no kernels needed): KL divergence per bit on the trained fixture.

    PYTHONPATH=. python tools/quality_grids.py                 # every candidate, prints markdown (~3 minutes)
    PYTHONPATH=. python tools/quality_grids.py --only "q3 int3 mse"

Each candidate is simulated: a copy of the f32 conversion whose quantized weights are overwritten in place with
their dequantized values (what a reader would compute, `w ~= s * level`), evaluated like `glm-perplexity --kl-base`
against the f32 conversion over the held-out windows (eval_tokens.json). Float arithmetic throughout, so a
candidate's numbers are its grid's alone. Roles not named by a candidate get what the q4 preset gives them (mse
search, uniform codes: int4 g64, int8 g64 for embed, lm_head, indexer and MTP); `bpw` counts codes plus F32 scales (and
offsets) of every tensor, as the container would store them.

Grids: `int` is format v1's uniform `clip(rint(w / s))` with the `mse` scale search (the real quantizer's codes);
`nl` looks each weight up in a fixed table of int8 levels (IQ4_NL-style: the container's nl4 levels for 4 bits,
with a simpler, positive-scale search than glm-convert's: 16 clip factors, each refitted by weighted least
squares); `asym` stores a
scale and an offset per group (`w ~= m + s u`, u in 0 .. 2^b - 1) searched over 8 shrinks of the group's range.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from glmkit.convert.convert import convert  # noqa: E402
from glmkit.convert.plan import QuantPlan  # noqa: E402
from glmkit.convert.quantizers import normalized_importance, search_scales  # noqa: E402
from glmkit.eval.evaluation import evaluate  # noqa: E402
from glmkit.eval.logits_file import LogitsBase, LogitsWriter  # noqa: E402
from glmkit.format.packing import NL4_LEVELS, expand_scales, packed_row_bytes, quantize, scales_shape  # noqa: E402
from glmkit.format.reader import Container  # noqa: E402
from glmkit.generate.engine import Engine  # noqa: E402
from tools.quality_table import FIXTURE, kl_cells  # noqa: E402

GROUP = 64
# IQ4_NL's 16 levels (llama.cpp ggml-quants, kvalues_iq4nl): non-uniform, denser near 0; the format's nl4 scheme
NL4_IQ4 = NL4_LEVELS.astype(np.float32)
# the 8 Lloyd-Max levels of a unit normal (+-0.2451, 0.7560, 1.3439, 2.1520) as int8, largest at 127
NL3_NORMAL = np.round(np.array([-2.1520, -1.3439, -0.7560, -0.2451, 0.2451, 0.7560, 1.3439, 2.1520]) / 2.1520
                      * 127).astype(np.float32)
_CLIPS = np.linspace(1.0, 2.0, 16)


def _element_weights(w: np.ndarray) -> np.ndarray:
    """The mse quantizer's `sqrt(sigma^2 + w^2)` per element of groups `[m, g]`."""
    sq = w * w
    return np.sqrt(sq.mean(axis=1, keepdims=True) + sq)


def _groups(w: np.ndarray, group: int) -> tuple[np.ndarray, int]:
    rows, cols = w.shape
    width = -(-cols // group) * group
    padded = np.zeros((rows, width), np.float32)
    padded[:, :cols] = w
    return padded.reshape(-1, group), width


def nl_dequant(w: np.ndarray, table: np.ndarray, group: int = GROUP, importance: np.ndarray | None = None
               ) -> np.ndarray:
    """`w [O, I]` -> `s * table[nearest]` per group, s searched over clip factors and refitted (weighted LS; input
    column j's error also weighted by importance[j] when given)."""
    rows, cols = w.shape
    g, width = _groups(w, group)
    e = _element_weights(g)
    if importance is not None:
        a = np.zeros(width, np.float32)
        a[:cols] = importance
        e *= np.broadcast_to(a, (rows, width)).reshape(-1, group)
    mids = (table[1:] + table[:-1]) / 2
    amax = np.maximum(np.abs(g).max(axis=1), 1e-12)
    top = np.abs(table).max()
    best_err = np.full(len(g), np.inf)
    best_s = amax / top
    for f in _CLIPS:
        s = amax / (top * f)
        t = table[np.searchsorted(mids, g / s[:, None])]
        num = (e * g * t).sum(axis=1)
        den = np.maximum((e * t * t).sum(axis=1), 1e-30)
        s2 = np.maximum(num / den, 1e-12)
        t2 = table[np.searchsorted(mids, g / s2[:, None])]
        err = (e * (g - s2[:, None] * t2) ** 2).sum(axis=1)
        better = err < best_err
        best_err, best_s = np.where(better, err, best_err), np.where(better, s2, best_s)
    out = best_s[:, None] * table[np.searchsorted(mids, g / best_s[:, None])]
    return out.reshape(rows, width)[:, :cols]


def asym_dequant(w: np.ndarray, bits: int, group: int) -> np.ndarray:
    """`w ~= m + s u`, u in 0 .. 2^bits - 1 per group: range [lo, hi] shrunk about its centre by 8 factors, the
    codes' least-squares (s, m) kept when it lowers the weighted error."""
    rows, cols = w.shape
    g, width = _groups(w, group)
    e = _element_weights(g)
    levels = (1 << bits) - 1
    lo0, hi0 = g.min(axis=1), g.max(axis=1)
    best_err = np.full(len(g), np.inf)
    best = np.zeros_like(g)
    for shrink in np.linspace(1.0, 0.65, 8):
        mid, half = (lo0 + hi0) / 2, (hi0 - lo0) / 2 * shrink
        lo, s = mid - half, np.maximum(2 * half / levels, 1e-12)
        u = np.clip(np.rint((g - lo[:, None]) / s[:, None]), 0, levels)
        # weighted least squares for (s, m) given u
        sw, su, suu = e.sum(1), (e * u).sum(1), (e * u * u).sum(1)
        sx, sux = (e * g).sum(1), (e * u * g).sum(1)
        det = sw * suu - su * su
        ok = det > 1e-20
        s_fit = np.where(ok, (sw * sux - su * sx) / np.where(ok, det, 1), s)
        m_fit = np.where(ok, (sx - s_fit * su) / np.where(sw > 0, sw, 1), lo)
        for s_c, m_c in ((s, lo), (s_fit, m_fit)):
            u_c = np.clip(np.rint((g - m_c[:, None]) / np.maximum(s_c, 1e-12)[:, None]), 0, levels)
            rec = m_c[:, None] + s_c[:, None] * u_c
            err = (e * (g - rec) ** 2).sum(1)
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best[better] = rec[better]
    return best.reshape(rows, width)[:, :cols]


def int_dequant(w: np.ndarray, bits: int, group: int | None = GROUP, quantizer: str = "mse",
                importance: np.ndarray | None = None) -> np.ndarray:
    """Format v1's codes and scales (the converter's `mse` search, or absmax), dequantized."""
    scales = search_scales(w, bits, group, importance) if quantizer == "mse" else None
    codes, scales = quantize(w, bits, group, scales)
    return codes * expand_scales(scales, w.shape[1], group)


# (dequantized values of w given its input columns' importance or None, stored bytes of a shape)
Scheme = tuple[Callable[[np.ndarray, np.ndarray | None], np.ndarray], Callable[[tuple[int, int]], int]]


def int_scheme(bits: int, quantizer: str = "mse", group: int = GROUP) -> Scheme:
    return (lambda w, a: int_dequant(w, bits, group, quantizer, a),
            lambda shape: shape[0] * packed_row_bytes(shape[1], bits) + 4 * int(np.prod(scales_shape(shape, group))))


def nl_scheme(table: np.ndarray, bits: int) -> Scheme:
    return (lambda w, a: nl_dequant(w, table, importance=a),
            lambda shape: shape[0] * packed_row_bytes(shape[1], bits) + 4 * int(np.prod(scales_shape(shape, GROUP))))


def asym_scheme(bits: int, group: int) -> Scheme:
    return (lambda w, a: asym_dequant(w, bits, group),
            lambda shape: shape[0] * -(-shape[1] * bits // 8) + 8 * int(np.prod(scales_shape(shape, group))))


# the RMSNorm whose output a weight multiplies (input column j is scaled by its gamma_j): a data-free proxy of
# E[x_j^2]; o_proj and down_proj read no norm's output
NORM_INPUTS = {"q_a_proj": "input_layernorm", "kv_a_proj_with_mqa": "input_layernorm", "wk": "input_layernorm",
               "weights_proj": "input_layernorm", "q_b_proj": "self_attn.q_a_layernorm",
               "wq_b": "self_attn.q_a_layernorm", "kv_b_proj": "self_attn.kv_a_layernorm",
               "gate_proj": "post_attention_layernorm", "up_proj": "post_attention_layernorm"}


def norm_importance(container: Container, name: str) -> np.ndarray | None:
    """`gamma_j^2` of the norm feeding weight `name` (normalised to mean 1), or None."""
    if name == "lm_head.weight":
        gamma = container.weight("model.norm.weight")
    elif name.endswith("eh_proj.weight"):
        prefix = name[: -len("eh_proj.weight")]
        gamma = np.concatenate([container.weight(prefix + "enorm.weight"), container.weight(prefix + "hnorm.weight")])
    else:
        parts = name.split(".")
        norm = NORM_INPUTS.get(parts[-2]) if len(parts) > 3 else None
        if norm is None:
            return None
        gamma = container.weight(".".join(parts[:3]) + "." + norm + ".weight")
    return normalized_importance(np.asarray(gamma, np.float64) ** 2)


INT4_ROLES = ("routed_expert", "shared_expert", "dense_mlp", "attention")
INT8_ROLES = ("embed", "lm_head", "indexer", "mtp")
# label -> (the schemes of the roles it changes (all other quantized roles: the q4 preset's mse), whether every
# search is weighted by `norm_importance`)
CANDIDATES: dict[str, tuple[dict[str, Scheme], bool]] = {
    "q4 int4 absmax": (dict.fromkeys(INT4_ROLES, int_scheme(4, "absmax")), False),
    "q4 int4 mse": ({}, False),
    "q4 int4 mse, norm-gamma importance": ({}, True),
    "q4 nl4 IQ4_NL table": (dict.fromkeys(INT4_ROLES, nl_scheme(NL4_IQ4, 4)), False),
    "q4 nl4 IQ4_NL table, norm-gamma importance": (dict.fromkeys(INT4_ROLES, nl_scheme(NL4_IQ4, 4)), True),
    "q4 asym int4 g128": (dict.fromkeys(INT4_ROLES, asym_scheme(4, 128)), False),
    "q4 asym int4 g64": (dict.fromkeys(INT4_ROLES, asym_scheme(4, 64)), False),
    "q3 int3 absmax": ({"routed_expert": int_scheme(3, "absmax")}, False),
    "q3 int3 mse": ({"routed_expert": int_scheme(3)}, False),
    "q3 nl3 normal table": ({"routed_expert": nl_scheme(NL3_NORMAL, 3)}, False),
    "q3 asym int3 g64": ({"routed_expert": asym_scheme(3, 64)}, False),
    "q2 int2 mse": ({"routed_expert": int_scheme(2)}, False),
}


def simulate(f32_dir: Path, out: Path, schemes: dict[str, Scheme], by_norms: bool) -> tuple[int, int]:
    """Copy the f32 container to `out` and overwrite its quantized roles' weights with their dequantized values
    (`by_norms`: every weight's search weighted by `norm_importance`); returns (bytes the quantized
    container would store, logical parameters)."""
    shutil.copytree(f32_dir, out)
    defaults = {**dict.fromkeys(INT4_ROLES, int_scheme(4)), **dict.fromkeys(INT8_ROLES, int_scheme(8))}
    source = Container(f32_dir)
    manifest = source.manifest
    total = params = 0
    for name, e in manifest.tensors.items():
        count = int(np.prod(e.shape))
        params += count
        scheme = schemes.get(e.role, defaults.get(e.role)) if len(e.shape) == 2 else None
        if scheme is None:
            total += e.nbytes
            continue
        fake, stored = scheme
        data = np.memmap(out / e.file, np.float32, "r+", e.offset, (count,)).reshape(e.shape)
        importance = norm_importance(source, name) if by_norms else None
        data[:] = fake(np.array(data), importance)
        data.flush()
        total += stored(e.shape)
    return total, params


def run(fixture: Path, work: Path, only: list[str] | None) -> list[dict[str, Any]]:
    windows = json.loads((fixture / "eval_tokens.json").read_text())
    f32_dir, base_path = work / "f32", work / "base.safetensors"
    convert(fixture, f32_dir, QuantPlan.from_preset("f32"), "f32", force=True, progress=False)
    engine = Engine(f32_dir, "numpy", load_tokenizer=False)
    writer = LogitsWriter(base_path, engine.model_hash, windows, engine.config.vocab_size)
    evaluate(engine, windows, save=writer)
    writer.close()
    rows = []
    for label, (schemes, by_norms) in CANDIDATES.items():
        if only and label not in only:
            continue
        out = work / label.replace(" ", "_").replace("(", "").replace(")", "")
        nbytes, params = simulate(f32_dir, out, schemes, by_norms)
        metrics = evaluate(Engine(out, "numpy", load_tokenizer=False), windows, LogitsBase(base_path))
        row = {"variant": label, "bytes": nbytes, "bpw": nbytes * 8 / params, **metrics}
        rows.append(row)
        print(f"{label}: {json.dumps({k: v for k, v in row.items() if k != 'variant'})}", file=sys.stderr)
        shutil.rmtree(out)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| candidate | size | bpw | ppl ratio | KLD mean | KLD p99 | top-1 |", "|---|---|---|---|---|---|---|"]
    out += [f"| {r['variant']} | {r['bytes'] / 1e6:.3f} MB | {r['bpw']:.2f} | {kl_cells(r)} |" for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixture", type=Path, default=FIXTURE)
    ap.add_argument("--json", type=Path, help="write the raw numbers here")
    ap.add_argument("--only", action="append", help="measure only this candidate (repeatable)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(args.fixture, Path(tmp), args.only)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
