"""Activation statistics for the quantizer (what `glm-calibrate` writes): per linear weight the mean square of
each input column, and optionally the full second moment `mean x x^T` `[I, I]` for the `gptq` quantizer.

A recording backend wraps the engine's: every product's input passes through its `linear`, under the name of
the weight it multiplies (per routed expert only its tokens; the MTP layer included); kv_b's, every key's latent
row, is taken from the KV cache after the window. Weights fed the very same
input rows (q_a and kv_a, an expert's gate and up) share one Hessian. The runtime collects, the converter only
reads the file: convert never imports the runtime.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from glmkit.errors import GlmkitError
from glmkit.eval.logits_file import tokens_digest
from glmkit.eval.windows import DEFAULT_CTX, token_windows, tokenized_windows
from glmkit.format.config import ModelConfig
from glmkit.format.imatrix import Imatrix
from glmkit.format.schema import expert_weight_name, layer_prefix
from glmkit.format.tensors import Weight
from glmkit.generate.engine import Engine
from glmkit.generate.tokenizer import ChatTokenizer
from glmkit.model.compute import Backend, moe_layer
from glmkit.model.glm5 import GlmMoeDsaModel, WeightSource
from glmkit.model.layer_spec import LayerSpec
from glmkit.model.ops import silu

HESSIAN_CHOICES = ("pooled", "dense", "all", "none")
DEFAULT_MAX_HESSIAN_DIM = 8192


class NamedWeights:
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


class RecordingBackend:
    """Delegates to a backend; `linear` also adds `sum x^2` per input column under the weight's name, and
    `sum x x^T` under the name of the first weight that saw the same input rows (`owner`)."""

    def __init__(self, inner: Backend, weights: NamedWeights, hessians: str = "pooled",
                 max_hessian_dim: int = DEFAULT_MAX_HESSIAN_DIM):
        self.inner = inner
        self.weights = weights
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {}
        self.hessians = hessians
        self.max_hessian_dim = max_hessian_dim
        self.products: dict[str, np.ndarray] = {}  # owner weight -> sum x x^T, float64 [I, I]
        self.owner: dict[str, str] = {}  # weight -> the owner of its Hessian
        self.seen: dict[bytes, str] = {}  # digest of an input -> owner that accumulated it, this window
        self.recorded_apart: set[str] = set()  # weights whose inputs the caller records (`record`), not `linear`

    def wants_hessian(self, name: str, in_features: int) -> bool:
        if self.hessians == "none" or in_features > self.max_hessian_dim:
            return False
        return self.hessians == "all" or ".mlp.experts." not in name

    def record_hessian(self, name: str, x: np.ndarray) -> None:
        x = np.ascontiguousarray(x, np.float32)
        digest = hashlib.blake2b(x.tobytes(), digest_size=16).digest() + str(x.shape).encode()
        owner = self.owner.setdefault(name, self.seen.get(digest, name))
        if owner != name:
            if self.seen.get(digest) != owner:  # the sharing seen before does not hold: a model-order bug
                raise GlmkitError(f"calibration: {name} no longer shares the inputs of {owner}")
            return
        self.seen[digest] = name
        product = x.T.astype(np.float64) @ x
        if name in self.products:
            self.products[name] += product
        else:
            self.products[name] = product

    def new_window(self) -> None:
        self.seen.clear()

    def reset(self) -> None:
        """Forget everything recorded (a new set of weights follows)."""
        for recorded in (self.sums, self.counts, self.products, self.owner, self.seen):
            recorded.clear()

    def statistics(self, config: ModelConfig, model_hash: str, windows: list[list[int]]) -> Imatrix:
        """What was recorded, as the imatrix of `windows` (means over the rows each weight saw)."""
        values = {n: (s / self.counts[n]).astype(np.float32) for n, s in self.sums.items()}
        tensors = {owner: f"hessian.{i}" for i, owner in enumerate(sorted(self.products))}
        data = {tensors[o]: (p / self.counts[o]).astype(np.float32) for o, p in self.products.items()}
        hessian_of = {w: tensors[o] for w, o in self.owner.items()}
        if self.hessians == "pooled":
            hessian_of.update(pooled_expert_hessians(config, values, hessian_of))
        return Imatrix(values, dict(self.counts), model_hash, sum(len(w) for w in windows), tokens_digest(windows),
                       hessian_of, data)

    def decode_step(self, config: ModelConfig, layers: Sequence[LayerSpec], weight: Callable[[str], Weight],
                    experts: None = None, kv_dtype: str = "f32", rows: int = 1, draft: Any = None, span: Any = None,
                    logits: bool = True, sequences: bool = False, mtp: Any = None) -> None:
        return None  # every product's input must pass through `linear`

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def record(self, name: str, x: np.ndarray) -> None:
        """Add the input rows `x [n, I]` of weight `name` to its statistics."""
        energy = np.einsum("si,si->i", x, x, dtype=np.float64)
        if name in self.sums:
            self.sums[name] += energy
        else:
            self.sums[name] = energy
        self.counts[name] = self.counts.get(name, 0) + x.shape[0]
        if self.wants_hessian(name, x.shape[1]):
            self.record_hessian(name, x)

    def linear(self, x: np.ndarray, w: Weight) -> np.ndarray:
        entry = self.weights.names.get(id(w))
        if entry is not None and entry[1] is w and entry[0] not in self.recorded_apart:
            self.record(entry[0], x)
        return self.inner.linear(x, w)

    # Composite operations run here, on top of `linear`, so every weight they use is recorded (a backend's own
    # fused versions would bypass the recording). Same math as NumpyBackend's.

    def expert_mlp(self, x: np.ndarray, gate: Weight, up: Weight, down: Weight) -> np.ndarray:
        return self.linear(silu(self.linear(x, gate)) * self.linear(x, up), down)

    def moe(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, expert: Any, shared: Any,
            done: Any = None) -> np.ndarray:
        # the serial batch-union loop, so that every expert's products go through `linear` above
        return moe_layer(self, x, ids, weights, expert, shared, done=done)  # type: ignore[arg-type]


def collect_imatrix(engine: Engine, windows: list[list[int]], progress: bool = False, hessians: str = "pooled",
                    max_hessian_dim: int = DEFAULT_MAX_HESSIAN_DIM) -> Imatrix:
    """Run every window through the main model and the MTP layer, recording linear-input statistics."""
    if hessians not in HESSIAN_CHOICES:
        raise GlmkitError(f"--hessians: {hessians!r} is not one of {', '.join(HESSIAN_CHOICES)}")
    weights = NamedWeights(engine.experts)
    backend = RecordingBackend(engine.backend, weights, hessians, max_hessian_dim)
    model = GlmMoeDsaModel(engine.config, weights, backend)  # type: ignore[arg-type]
    # kv_b's input is every key's latent row (what reconstructing its keys multiplies), recorded from the cache after
    # each window: attention over DSA's chosen keys absorbs kv_b into the queries instead
    backend.recorded_apart = {spec.attention.kv_b for spec in model.layers}
    limit = engine.config.max_position_embeddings
    bar = tqdm(total=sum(len(w) for w in windows), unit="tok", desc="calibrate", file=sys.stderr,
               disable=not progress)
    try:
        for i, w in enumerate(windows):
            if len(w) > limit:
                raise GlmkitError(f"window {i} has {len(w)} tokens, more than the model's {limit} positions")
            ids = np.asarray(w, dtype=np.int64)
            backend.new_window()
            cache = model.new_cache()
            _, hidden = model.forward(ids, cache)
            if model.has_mtp and len(ids) > 1:
                model.mtp_forward(hidden[:-1], ids[1:], cache)
            for i, spec in enumerate(model.layers):
                if cache.layer(i).length:
                    backend.record(spec.attention.kv_b, cache.layer(i).kv_lat)
            weights.clear()
            bar.update(len(w))
    finally:
        bar.close()
    return backend.statistics(engine.config, engine.model_hash, windows)


def pooled_expert_hessians(config: ModelConfig, values: dict[str, np.ndarray], hessian_of: dict[str, str]
                           ) -> dict[str, str]:
    """Routed experts' gate/up weight -> their layer's MoE-input Hessian (the shared expert's gate, which sees
    every token), for the experts calibration reached: close to each expert's own Hessian at no extra memory
    (docs/QUALITY.md)."""
    pooled: dict[str, str] = {}
    for layer in range(config.num_layers_with_mtp):
        shared = hessian_of.get(f"{layer_prefix(layer)}mlp.shared_experts.gate_proj.weight")
        if shared is None:  # a dense layer, no shared expert, or an input over --max-hessian-dim
            continue
        for expert in range(config.n_routed_experts):
            for projection in ("gate_proj", "up_proj"):
                name = expert_weight_name(layer, expert, projection)
                if name in values:
                    pooled[name] = shared
    return pooled


def calibration_windows(snapshot_dir: Path, config: ModelConfig, path: Path, ctx: int = DEFAULT_CTX
                        ) -> list[list[int]]:
    """Windows from a `.json` list of token-id lists, or from UTF-8 text cut into `ctx`-token windows by the
    tokenizer in `snapshot_dir` (a source snapshot's side files)."""
    if path.suffix == ".json":
        return token_windows(path, config.vocab_size)
    return tokenized_windows(ChatTokenizer(snapshot_dir, config.vocab_size), path,
                             min(ctx, config.max_position_embeddings))
