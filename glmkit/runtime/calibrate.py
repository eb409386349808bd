"""`glm-calibrate SNAPSHOT (--text FILE | --tokens FILE) -o IMATRIX`: activation statistics for the quantizer.

Runs the converted model (best: the f32 conversion, or q8 for a model too big for that) over sample text
and records, for every linear weight, the mean square of each input column (`mean x_j^2` over the rows
that went through it; per routed expert only its tokens; the MTP layer included). `glm-convert --imatrix`
then weights each weight's quantization error by it (imatrix-style, DESIGN section 4 is unchanged: only
the choice of scales differs). The runtime collects, the converter only reads a file: convert never
imports runtime.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from glmkit.errors import GlmkitError
from glmkit.formats.imatrix import Imatrix
from glmkit.formats.tensors import Weight
from glmkit.runtime.backend import Backend, NumpyBackend, silu
from glmkit.runtime.cli_perplexity import DEFAULT_CTX, text_windows, token_windows
from glmkit.runtime.engine import Engine
from glmkit.runtime.logits_file import tokens_digest
from glmkit.runtime.model import GlmMoeDsaModel, WeightSource


class _NamedWeights:
    """A weight source that remembers which name each returned array was asked for (by identity)."""

    def __init__(self, inner: WeightSource):
        self.inner = inner
        self.names: dict[int, tuple[str, Weight]] = {}  # id -> (name, the object, kept alive)

    def has(self, name: str) -> bool:
        return self.inner.has(name)

    def weight(self, name: str) -> Weight:
        w = self.inner.weight(name)
        self.names[id(w)] = (name, w)
        return w

    def clear(self) -> None:
        self.names.clear()


class _RecordingBackend:
    """Delegates to a backend; `linear` also adds `sum x^2` per input column under the weight's name."""

    def __init__(self, inner: Backend, weights: _NamedWeights):
        self.inner = inner
        self.weights = weights
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def linear(self, x: np.ndarray, w: Weight) -> np.ndarray:
        entry = self.weights.names.get(id(w))
        if entry is not None and entry[1] is w:
            name = entry[0]
            energy = np.einsum("si,si->i", x, x, dtype=np.float64)
            if name in self.sums:
                self.sums[name] += energy
            else:
                self.sums[name] = energy
            self.counts[name] = self.counts.get(name, 0) + x.shape[0]
        return self.inner.linear(x, w)

    # Composite operations run here, on top of `linear`, so every weight they use is recorded (a backend's own
    # fused versions would bypass the recording). Same math as NumpyBackend's.

    def expert_mlp(self, x: np.ndarray, gate: Weight, up: Weight, down: Weight) -> np.ndarray:
        return self.linear(silu(self.linear(x, gate)) * self.linear(x, up), down)

    def moe(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, expert: Any, shared: Any) -> np.ndarray:
        # the reference batch-union loop, so that every expert's products go through `linear` above
        return NumpyBackend.moe(self, x, ids, weights, expert, shared)  # type: ignore[arg-type]


def collect(engine: Engine, windows: list[list[int]], progress: bool = False) -> Imatrix:
    """Run every window through the main model and the MTP layer, recording linear-input energies."""
    weights = _NamedWeights(engine.experts)
    backend = _RecordingBackend(engine.backend, weights)
    model = GlmMoeDsaModel(engine.config, weights, backend)  # type: ignore[arg-type]
    limit = engine.config.max_position_embeddings
    bar = tqdm(total=sum(len(w) for w in windows), unit="tok", desc="calibrate", file=sys.stderr,
               disable=not progress)
    try:
        for i, w in enumerate(windows):
            if len(w) > limit:
                raise GlmkitError(f"window {i} has {len(w)} tokens, more than the model's {limit} positions")
            ids = np.asarray(w, dtype=np.int64)
            cache = model.new_cache()
            _, hidden = model.forward(ids, cache)
            if model.has_mtp and len(ids) > 1:
                model.mtp_forward(hidden[:-1], ids[1:], cache)
            weights.clear()
            bar.update(len(w))
    finally:
        bar.close()
    values = {n: (s / backend.counts[n]).astype(np.float32) for n, s in backend.sums.items()}
    return Imatrix(values, dict(backend.counts), engine.model_hash, sum(len(w) for w in windows),
                   tokens_digest(windows))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glm-calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshot", help="converted container directory (f32, or q8 for a large model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", type=Path, metavar="FILE", help="UTF-8 sample text, cut into --ctx windows")
    src.add_argument("--tokens", type=Path, metavar="FILE", help="JSON list of token-id lists")
    p.add_argument("--ctx", type=int, default=DEFAULT_CTX, help=f"window length for --text (default {DEFAULT_CTX})")
    p.add_argument("--max-windows", type=int, metavar="N", help="use only the first N windows")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="IMATRIX", help="imatrix file to write")
    p.add_argument("--device", default="auto", help="auto | numpy | opencl[:platform:device]")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.max_windows is not None and args.max_windows < 1:
            raise GlmkitError(f"--max-windows: must be at least 1, got {args.max_windows}")
        engine = Engine(args.snapshot, args.device, load_tokenizer=args.text is not None)
        windows = (text_windows(engine, args.text, args.ctx) if args.text is not None
                   else token_windows(args.tokens, engine.config.vocab_size))
        windows = windows[:args.max_windows]
        imatrix = collect(engine, windows, progress=not args.quiet)
        imatrix.write(args.output)
    except GlmkitError as e:
        print(f"glm-calibrate: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("glm-calibrate: interrupted", file=sys.stderr)
        return 130
    print(f"{args.output}: {len(imatrix.values)} weights from {imatrix.tokens} tokens in {len(windows)} windows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
