"""`glm-convert --calibrate`: GPTQ statistics made while converting, one decoder layer at a time, from the source.

The converter writes the model in order: the embedding, each decoder layer, the MTP layer, the final norm and
lm_head. `LayerwiseCalibration` runs the calibration windows through the model in the same order, as the
converter reaches each part (`prepare`): before a layer's first tensor is written, that layer's source tensors are
read (routed experts as tokens reach them) and the layer runs on the current hidden states of every window through
the recording backend (calibration.py: the column energies and Hessians of its linears, as `glm-calibrate
--hessians pooled` records them); the converter quantizes the layer from them and writes it; then the layer runs
on what was written (`propagate="quantized"`: the inputs the quantized model will see, GPTQ's order) or keeps the
recording run's output (`"source"`) as the next layer's input. The MTP layer takes the final norm of the main
model's output and the next tokens' embeddings; lm_head's statistics are its inputs from both heads.

The layer math is the model's (`GlmMoeDsaModel.decoder_layer`, `mtp_forward`) over weight sources that serve the
part being converted. Memory: one layer's source tensors (float32; of the routed experts, those tokens reached) and
its packed stored form, then that dequantized (float32), plus the windows' hidden states `[W, S, H]` float32. The
source is read once: a tensor read for the recording run is handed to the converter instead of being read again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from glmkit.backends.numpy_backend import NumpyBackend
from glmkit.convert.convert import Importance
from glmkit.convert.plan import QuantPlan
from glmkit.convert.sources.snapshot import HFSnapshot
from glmkit.errors import GlmkitError
from glmkit.eval.calibration import NamedWeights, RecordingBackend
from glmkit.eval.logits_file import tokens_digest
from glmkit.format.manifest import TensorEntry
from glmkit.format.packing import dequantize
from glmkit.format.safetensors_file import read_header, read_tensor
from glmkit.format.schema import TensorSpec
from glmkit.format.tensors import Weight
from glmkit.model.glm5 import GlmMoeDsaModel
from glmkit.model.layer_spec import EMBED, LM_HEAD, final_norm_spec

PROPAGATE_CHOICES = ("quantized", "source")
# a fixed count, not the machine's cores: how a product is split changes its rounding, hence the Hessians and the
# codes, which must depend on the inputs alone
WORKERS = 8
EMBED_GROUP = -1
HEAD_GROUP = 1 << 30  # the final norm and lm_head: after every layer


def _group(spec: TensorSpec) -> int:
    """The part of the model a tensor belongs to, in conversion order: the embedding, its layer, the head."""
    if spec.layer is not None:
        return spec.layer
    return EMBED_GROUP if spec.name == EMBED else HEAD_GROUP


class _PartWeights:
    """A weight source over the part being converted: `tensors` (filled by the caller) and, read from the source
    on first use, the others (`read`: any; else only float32-stored ones, the same before and after conversion).
    The embedding is the calibration tokens' rows; lm_head a zero-row stand-in: the runs need its input, not the
    logits."""

    def __init__(self, owner: LayerwiseCalibration, read: bool):
        self.owner = owner
        self.read = read
        self.tensors: dict[str, Weight] = {}
        self.stand_in = np.zeros((0, owner.config.hidden_size), np.float32)

    def has(self, name: str) -> bool:
        return name in self.owner.spec_by_name

    def weight(self, name: str) -> Weight:
        if name == LM_HEAD:
            return self.stand_in
        if name == EMBED:
            return self.owner.embed_table
        if name not in self.tensors:
            spec = self.owner.spec_by_name[name]
            if not self.read and self.owner.plan.quant_for(spec) is not None:
                raise GlmkitError(f"internal error: {name} is needed before it is converted")
            self.tensors[name] = self.owner.snapshot.load(spec)
        return self.tensors[name]


class LayerwiseCalibration(Importance):
    """GPTQ statistics of each layer from the calibration `windows` (token-id lists) run through the source as it
    is converted (see the module docstring); pass it to `convert(..., calibration=)`."""


    def __init__(self, windows: list[list[int]], propagate: str = "quantized"):
        if propagate not in PROPAGATE_CHOICES:
            raise GlmkitError(f"calibration: propagate {propagate!r} is not one of {', '.join(PROPAGATE_CHOICES)}")
        if not windows or any(len(w) < 2 for w in windows):
            raise GlmkitError("calibration: needs at least one window of at least 2 tokens")
        self.use(None)
        self.token_lists = [[int(t) for t in w] for w in windows]
        self.windows = [np.asarray(w, np.int64) for w in self.token_lists]
        self.propagate = propagate
        # a layer's inputs come from every layer before it: a resumed run replays the completed layers from the
        # data files already written, which hold them as the propagating run uses them
        self.resumable = propagate == "quantized"
        self.written_before: dict[str, Path] = {}  # tensor -> the data file an earlier run completed it in

    def bind(self, snapshot: HFSnapshot, specs: list[TensorSpec], plan: QuantPlan) -> Importance:
        cfg = snapshot.config
        if plan.quantizer != "gptq":
            raise GlmkitError(f"--calibrate: makes statistics for --quantizer gptq, not {plan.quantizer}")
        for i, w in enumerate(self.windows):
            if len(w) > cfg.max_position_embeddings:
                raise GlmkitError(f"calibration window {i} has {len(w)} tokens, more than the model's "
                                  f"{cfg.max_position_embeddings} positions")
            if w.min() < 0 or w.max() >= cfg.vocab_size:
                raise GlmkitError(f"calibration window {i} holds token ids outside the vocabulary "
                                  f"(0..{cfg.vocab_size - 1})")
        self.snapshot, self.plan, self.config = snapshot, plan, cfg
        self.spec_by_name = {s.name: s for s in specs}
        self.groups: dict[int, list[TensorSpec]] = {}
        for s in specs:
            self.groups.setdefault(_group(s), []).append(s)
        self.vocab_rows = np.unique(np.concatenate(self.windows))
        self.embed_table = np.zeros((0, cfg.hidden_size), np.float32)  # filled as the embedding is converted
        self.source = _PartWeights(self, read=True)
        # prefill-sized products split over a pool of threads with single-threaded BLAS (NumpyBackend): a core
        # another process takes slows the pool instead of stalling multi-threaded BLAS's spin-waits
        self.workers = WORKERS
        self.recorder = RecordingBackend(NumpyBackend(workers=self.workers), NamedWeights(self.source), "pooled")
        self.recording = GlmMoeDsaModel(cfg, self.recorder.weights, self.recorder)  # type: ignore[arg-type]
        # kv_b's input is every key's latent row, recorded from the cache; lm_head's inputs go to `head`
        self.recorder.recorded_apart = {spec.attention.kv_b for spec in self.recording.layers} | {LM_HEAD}
        self.head = RecordingBackend(NumpyBackend(), NamedWeights(self.source), "pooled")
        if propagate_quantized := self.propagate == "quantized":
            self.stored = _PartWeights(self, read=False)
            self.propagating = GlmMoeDsaModel(cfg, self.stored, NumpyBackend(workers=self.workers))
        else:
            self.propagating = self.recording
        self.propagate_quantized = propagate_quantized
        self.current: int | None = None  # the group being converted
        self.hidden: list[np.ndarray] = []  # per window: the current layer's input `[S, H]`
        self.chosen: list[np.ndarray | None] = []  # per window: the DSA selection a 'shared' layer reuses
        self.final: list[np.ndarray] = []  # per window: the main model's output after the final norm `[S, H]`
        self.parts: dict[str, list[tuple[np.ndarray, np.ndarray | None]]] = {}  # stored row blocks, per tensor
        return self

    def record(self) -> dict[str, object]:
        return {"calibration": {"windows": len(self.windows), "tokens": sum(len(w) for w in self.windows),
                                "tokens_sha256": tokens_digest(self.token_lists), "hessians": "pooled",
                                "propagate": self.propagate}}

    def resume(self, out: Path, entries: dict[str, TensorEntry]) -> None:
        self.written_before = {name: out / e.file for name, e in entries.items() if e.role != "scales"}

    def reads(self, snapshot: HFSnapshot, spec: TensorSpec) -> set[str]:
        """Every shard of the tensor's part (the recording run reads the whole layer before its first tensor is
        written); the MTP layer's part also the final norm's."""
        files = set().union(*(snapshot.files_for(s) for s in self.groups[_group(spec)]))
        if spec.layer == self.config.num_hidden_layers:
            files |= snapshot.files_for(self.spec_by_name[final_norm_spec(self.config).weight])
        return files

    # ---- the converter's hooks -------------------------------------------------------------------

    def prepare(self, spec: TensorSpec) -> None:
        group = _group(spec)
        if group == self.current:
            return
        if self.current is not None:
            if group < self.current:
                raise GlmkitError(f"internal error: {spec.name} is converted after part {self.current}")
            self._finish(self.current)
        else:  # resumed: the parts before this one are in the data files already written
            for earlier in sorted(g for g in self.groups if g < group):
                self._replay(earlier)
        self.current = group
        if group == EMBED_GROUP:
            return  # no linear input
        if group == HEAD_GROUP:
            self.use(self.head.statistics(self.config, "", self.token_lists))
            return
        if group == 0:
            self.hidden = [self.embed_table[w] for w in self.windows]
            self.chosen = [None] * len(self.windows)
        self._run(self.recording, group)
        self.recorder.weights.clear()  # it keeps every weight it served alive
        self.use(self.recorder.statistics(self.config, "", self.token_lists))
        self.recorder.reset()

    def source_blocks(self, snapshot: HFSnapshot, spec: TensorSpec, rows: int) -> Iterator[np.ndarray]:
        read = self.source.tensors.pop(spec.name, None)
        if read is None:
            blocks = super().source_blocks(snapshot, spec, rows)
            if spec.name == EMBED and not self.propagate_quantized:
                return self._embedding_rows(spec, blocks)
            return blocks
        assert isinstance(read, np.ndarray)
        if spec.name in snapshot.tensors and len(spec.shape) == 2 and spec.shape[0] > rows:
            step = snapshot.block_rows(spec, rows)  # the blocks a read from the source gives
            return iter([read[i:i + step] for i in range(0, spec.shape[0], step)])
        return iter([read])

    def written(self, spec: TensorSpec, first_row: int, packed: np.ndarray, scales: np.ndarray | None) -> None:
        if spec.name == EMBED:
            if self.propagate_quantized:
                self._keep_embedding(spec, first_row, packed, scales)
        elif self.propagate_quantized and spec.layer is not None:
            self.parts.setdefault(spec.name, []).append((packed, scales))

    # ---- the runs --------------------------------------------------------------------------------

    def _run(self, model: GlmMoeDsaModel, group: int) -> None:
        """Layer `group` over every window on `model`: the recording run records the layer's statistics, the
        propagating run replaces the hidden states by its output (one run does both with propagate "source")."""
        layer = group
        recording, propagating = model is self.recording, model is self.propagating
        kv_b = model.layers[layer].attention.kv_b
        with threadpool_limits(1 if self.workers > 1 else None, user_api="blas"):
            for i, ids in enumerate(self.windows):
                self._window(model, layer, i, ids, recording, propagating, kv_b)

    def _window(self, model: GlmMoeDsaModel, layer: int, i: int, ids: np.ndarray, recording: bool,
                propagating: bool, kv_b: str) -> None:
        """Window `i` (tokens `ids`) through layer `layer` on `model` (see `_run`)."""
        self.recorder.new_window()
        cache = model.new_cache()
        if layer < self.config.num_hidden_layers:
            out, chosen = model.decoder_layer(layer, self.hidden[i], np.arange(len(ids)), cache.layer(layer),
                                              self.chosen[i])
            if propagating:
                self.hidden[i], self.chosen[i] = out, chosen
        else:
            _, out = model.mtp_forward(self.final[i][:-1], ids[1:], cache)
            if propagating:
                self.head.record(LM_HEAD, model.mtp_head_input(out))
        if recording:
            self.recorder.record(kv_b, cache.layer(layer).kv_lat)

    def _replay(self, group: int) -> None:
        """Part `group`, which an earlier run wrote, from the data files: the embedding's rows, or the windows
        propagated through a layer."""
        if group == EMBED_GROUP:
            spec = self.spec_by_name[EMBED]
            packed, scales = self._written_before(spec)
            self._keep_embedding(spec, 0, packed, scales)
            return
        if group == 0:
            self.hidden = [self.embed_table[w] for w in self.windows]
            self.chosen = [None] * len(self.windows)
        self._finish(group)

    def _written_before(self, spec: TensorSpec) -> tuple[np.ndarray, np.ndarray | None]:
        """A tensor (and its scales) from the data file an earlier run completed."""
        path = self.written_before[spec.name]
        header = read_header(path)
        scales = header.get(spec.name + ".qs")
        return read_tensor(path, header[spec.name]), None if scales is None else read_tensor(path, scales)

    def _finish(self, group: int) -> None:
        """The converter wrote part `group`: propagate the windows through it."""
        if group in (EMBED_GROUP, HEAD_GROUP):
            return
        self.source.tensors.clear()  # those of an earlier run's tensors, read for the recording run
        if self.propagate_quantized:
            for spec in self.groups[group]:
                if spec.name not in self.parts and spec.name in self.written_before:
                    self.parts[spec.name] = [self._written_before(spec)]
            self.stored.tensors = {name: self._stored(self.spec_by_name[name], blocks)
                                   for name, blocks in self.parts.items()}
            self.parts.clear()
            self._run(self.propagating, group)
            self.stored.tensors.clear()
        if group == self.config.num_hidden_layers - 1:  # lm_head's input, and the MTP layer's
            self.final = [self.propagating.final_norm(x) for x in self.hidden]
            for rows in self.final:
                self.head.record(LM_HEAD, rows)
            self.hidden, self.chosen = [], []

    def _stored(self, spec: TensorSpec, blocks: list[tuple[np.ndarray, np.ndarray | None]]) -> np.ndarray:
        """A tensor as the converter stored it, from its row blocks, dequantized once: every window multiplies it
        (the same values the runtime unpacks; no larger than the source tensors the recording run held)."""
        values = np.concatenate([b for b, _ in blocks]) if len(blocks) > 1 else blocks[0][0]
        quant = self.plan.quant_for(spec)
        if quant is None:
            return values
        scales = np.concatenate([s for _, s in blocks if s is not None])
        return dequantize(values, scales, quant[0], quant[1], spec.shape[1], self.plan.scheme_for(quant[0]))

    def _embedding_rows(self, spec: TensorSpec, blocks: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
        """The source embedding's blocks, passed through; the calibration tokens' rows are kept."""
        first = 0
        for block in blocks:
            self._keep_embedding(spec, first, block, None)
            first += len(block)
            yield block

    def _keep_embedding(self, spec: TensorSpec, first_row: int, block: np.ndarray, scales: np.ndarray | None
                        ) -> None:
        """Copy the calibration tokens' rows among embedding rows `first_row..` (float32, or packed with
        `scales`) into the table; np.zeros maps its pages lazily, so only those rows take memory."""
        if len(self.embed_table) == 0:
            self.embed_table = np.zeros(spec.shape, np.float32)
        ids = self.vocab_rows[(self.vocab_rows >= first_row) & (self.vocab_rows < first_row + len(block))]
        rows = block[ids - first_row]
        if scales is not None:
            quant = self.plan.quant_for(spec)
            assert quant is not None
            rows = dequantize(rows, scales[ids - first_row], quant[0], quant[1], spec.shape[1],
                              self.plan.scheme_for(quant[0]))
        self.embed_table[ids] = rows
