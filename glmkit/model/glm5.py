"""The GLM-5 (`glm_moe_dsa`) forward pass: MLA attention with the DSA indexer, noaux_tc MoE, MTP.

Math follows DESIGN section 3 (transformers 5.23.0, float32). Rows are vectors and `W` is `[out, in]`:
`y = x W^T`. The small pure functions below are the paper's equations; `GlmMoeDsaModel` runs each layer's stages
as `glmkit.model.layer_spec` describes them (tensor names, constants, which stages) over a weight source and a
`Backend` that does the heavy lifting.

Every layer method takes the positions of its rows explicitly: `forward` appends a contiguous block at the end
of the cache, and the same methods recompute rows in place at chosen positions (glmkit.cache.blend).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from glmkit.errors import GlmkitError
from glmkit.format.config import ModelConfig
from glmkit.format.tensors import Weight
from glmkit.model.compute import (
    Backend,
    DecodeStep,
    ExpertArena,
    PipelinedDecode,
    PipelinedRows,
    Routes,
    TokenDraws,
    TokenMask,
)
from glmkit.model.kv_cache import KV_DTYPES, KVCache, LayerKV, kv_bytes_per_token
from glmkit.model.layer_spec import (
    EMBED,
    LM_HEAD,
    AttentionSpec,
    LayerSpec,
    MLPSpec,
    MoESpec,
    MTPSpec,
    NormSpec,
    final_norm_spec,
    layer_spec,
    mtp_spec,
)
from glmkit.model.ops import embed_rows, position_mask, rope_cos_sin, route_noaux_tc


class WeightSource(Protocol):
    """Tensors by Hugging Face name; f32 arrays are read-only views, 1-D tensors always f32 arrays."""

    def weight(self, name: str) -> Weight: ...

    def has(self, name: str) -> bool: ...


ChosenKeys = np.ndarray | None
"""A DSA selection `[S, K]` int32 (-1 padded), or None: every causal key."""
Selection = TypeVar("Selection")  # one sequence's ChosenKeys, or a list of them (one per sequence of a batch)

RouteHook = Callable[[int, np.ndarray, np.ndarray | None], None]
"""Called as `hook(layer, expert_ids [S, k], normed_input [S, H])` right after routing, before any expert runs;
after a device decode step, as `hook(layer, expert_ids [1, k], None)` once the token ran."""


VERIFY_ROWS = 2  # the rows of MTP's verification forward: the last token and one draft
# Rows of a prompt per dense-MLP pass: its `[rows, intermediate]` products stay a few MB each; the weights'
# repeated dequantization per block costs a few percent of the block's GEMMs.
DENSE_MLP_ROWS = 512
# float32 values per hidden unit that a prefill holds per prompt token at its peak (a 2,048-token chunk of the
# 256-expert benchmark model: ~15; docs/BENCHMARKS.md, out of core)
PREFILL_ROW_FLOATS = 20
MIN_PREFILL_ROWS = 128
# float32 values per hidden unit that a prompt run layer by layer (`layers_by_layer`) holds per token of its span at
# its peak, its feed-forward: the residual rows, their norm, the MoE's output and its experts' rows (~7.4 a token and
# ~30 MB besides on the 256-expert benchmark model: 9.3-14.7 over spans of 4,096-1,400 rows; docs/BENCHMARKS.md)
SPAN_ROW_FLOATS = 12


def prefill_rows_within(config: ModelConfig, nbytes: int) -> int:
    """The prompt rows one forward may take so that its temporaries stay within `nbytes` (at least
    MIN_PREFILL_ROWS)."""
    return max(MIN_PREFILL_ROWS, nbytes // (config.hidden_size * 4 * PREFILL_ROW_FLOATS))


def prefill_bytes(config: ModelConfig, rows: int) -> int:
    """The bytes of temporaries a forward of `rows` prompt rows holds at its peak (as `prefill_rows_within` counts)."""
    return rows * config.hidden_size * 4 * PREFILL_ROW_FLOATS


def row_blocks(n: int, rows: int) -> list[slice]:
    """Slices of at most `rows` rows covering `n` rows in order."""
    return [slice(b, b + rows) for b in range(0, n, rows)]


def span_rows_within(config: ModelConfig, nbytes: int) -> tuple[int, int]:
    """(span, block): the prompt rows one forward run layer by layer may take, and its attention's rows per block,
    so that its temporaries stay within `nbytes`: a quarter for a block's, the rest for the span's."""
    block = prefill_rows_within(config, nbytes // 4)
    return max(block, (nbytes - nbytes // 4) // (config.hidden_size * 4 * SPAN_ROW_FLOATS)), block

# ---- pure functions ----------------------------------------------------------------------------

def mla_attend_full(backend: Backend, q_nope: np.ndarray, q_rot: np.ndarray, kv_lat: np.ndarray,
                    k_rot: np.ndarray, kv_b: Weight, allowed: np.ndarray, scale: float) -> np.ndarray:
    """MLA by reconstruction: `kv = kv_lat Wkv_b^T` per head `[k_nope | v]`; returns `[S, nh, v]`.

    q_nope `[S, nh, nope]`, q_rot `[S, nh, rope]` (roped), kv_lat `[T, kvl]`, k_rot `[T, rope]` (roped).
    """
    total = kv_lat.shape[0]
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    kv = backend.linear(kv_lat, kv_b).reshape(total, heads, -1)
    keys = np.concatenate([kv[..., :nope], np.broadcast_to(k_rot[:, None, :], (total, heads, k_rot.shape[1]))],
                          axis=-1)
    return backend.attention(np.concatenate([q_nope, q_rot], axis=-1), keys, kv[..., nope:], allowed, scale)


def mla_attend_absorbed(backend: Backend, q_nope: np.ndarray, q_rot: np.ndarray, kv_lat: np.ndarray,
                        k_rot: np.ndarray, kv_b: Weight, keys_seen: np.ndarray, scale: float) -> np.ndarray:
    """MLA with `kv_b` absorbed (same math as `mla_attend_full`, no per-key reconstruction).

    `q_nope . (Wk_b kv_lat) = (q_nope Wk_b) . kv_lat`, so queries move into latent space and attend one
    shared key head `[kv_lat | k_rot]`; the weighted sum of `kv_lat` is lifted by `Wv_b` afterwards.
    keys_seen: a mask `[S, T]` bool, or DSA's chosen keys `[S, K]` int32 (`Backend.attention_chosen`: each query
    reads its own K latent rows, whatever T is).
    """
    nope = q_nope.shape[2]
    v_dim = kv_b.shape[0] // q_nope.shape[1] - nope
    q_lat = backend.head_matmul(q_nope, kv_b, 0, nope, transpose=True)  # [S, nh, kvl]
    q = np.concatenate([q_lat, q_rot], axis=-1)  # [S, nh, kvl + rope]
    if keys_seen.dtype == bool:
        keys = np.concatenate([kv_lat, k_rot], axis=-1)[:, None, :]  # [T, 1, kvl + rope]
        o_lat = backend.attention(q, keys, kv_lat[:, None, :], keys_seen, scale)  # [S, nh, kvl]
    else:  # the key parts joined per gathered row, not for all T
        o_lat = backend.attention_chosen(q, (kv_lat[:, None, :], k_rot[:, None, :]), kv_lat[:, None, :], keys_seen,
                                         scale)  # [S, nh, kvl]
    return backend.head_matmul(o_lat, kv_b, nope, v_dim, transpose=False)  # [S, nh, v]


# ---- the model ---------------------------------------------------------------------------------

@dataclass
class AttentionInputs:
    """What one layer's attention computes from its normed input before it looks at the cache (S rows):
    `q_nope [S, nh, nope]`, `q_rot [S, nh, rope]` (roped), `kv_lat [S, kv_lora]` (normed), `k_rot [S, rope]`
    (roped); DSA layers: `index_k [S, ihd]`, and when scores are needed `index_q [S, inh, ihd]` and
    `index_weights [S, inh]` (scaled by `inh^-1/2`)."""

    q_nope: np.ndarray
    q_rot: np.ndarray
    kv_lat: np.ndarray
    k_rot: np.ndarray
    index_k: np.ndarray | None = None
    index_q: np.ndarray | None = None
    index_weights: np.ndarray | None = None


class GlmMoeDsaModel:
    """GLM-5 forward over a weight source and a backend.

    absorb_max_rows: calls appending at most this many tokens to a non-empty cache use the absorbed
    MLA path (decode, MTP verification); others (prefill, rows recomputed in place) reconstruct keys and values.
    route_hook: optional `hook(layer, expert_ids [S, k], u [S, H])` (hit/miss counting, prefetch).
    ahead_hook: optional `hook(layer, u [S, H])` with a dense layer's normed MLP input, before the MLP runs (an expert
    cache starts reading the next layer's likely experts: the first MoE layer has no MoE layer before it to do so).
    ran_hook: optional `hook(layer, expert)` once a routed expert's rows have run and its weights are no longer read
    (an expert cache may then reuse its slot within the layer: a prompt's MoE runs each expert once).
    step_experts: where the backend's decode step reads the routed experts when the weight source moves them
    between slots (an expert cache: `ExpertArena`); None: the step binds every weight's bytes once.
    kv_dtype: the precision of the cache rows `new_cache` keeps (`KV_DTYPES`); attention reads them at it.
    """

    batches_sequences = True  # `decode_batch` can run: every layer's cache rows are in this process

    def __init__(self, config: ModelConfig, weights: WeightSource, backend: Backend,
                 absorb_max_rows: int = 4, route_hook: RouteHook | None = None,
                 step_route_hook: Callable[[int, np.ndarray], None] | None = None,
                 step_experts: ExpertArena | None = None, kv_dtype: str = "f32",
                 ahead_hook: Callable[[int, np.ndarray], None] | None = None,
                 ran_hook: Callable[[int, int], None] | None = None,
                 lend_hook: Callable[[int], None] | None = None) -> None:
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv dtype {kv_dtype!r}: not one of {', '.join(KV_DTYPES)}")
        self.config = config
        self.kv_dtype = kv_dtype
        self.weights = weights
        self.backend = backend
        self.absorb_max_rows = absorb_max_rows
        self.route_hook = route_hook
        self.ahead_hook = ahead_hook
        self.ran_hook = ran_hook
        # an expert cache that lends the KV rows' room (`ExpertCache.lend`): told the bytes the rows and a span's
        # lengthening need before they take them
        self.lend_hook = lend_hook
        self._held_kv_rows = 0  # what the sequences may come to hold, as `hold_kv_rows` was last told
        self._kv_row_bytes = kv_bytes_per_token(config, kv_dtype)  # what one position's KV rows take
        self.step_route_hook = step_route_hook  # a decode step's routing as it happens: `DecodeStep.watch_routes`
        self.step_experts = step_experts
        self.prefill_rows: int | None = None  # where memory is tight: the most prompt rows a forward should take
        # where routed experts are read per pass over the layers (an expert cache): prompts run layer by layer over
        # spans of this many rows, each layer's attention `prefill_rows` at a time (`layers_by_layer`)
        self.span_rows: int | None = None
        # where the memory keeps room for the KV rows of this many positions (an auto-sized expert cache): the room
        # the sequences do not fill lengthens a span while a prompt is prefilled (`prompt_chunk`)
        self.kv_room_tokens: int | None = None
        self._step: DecodeStep | None | bool = False  # the backend's decode step, asked for on the first forward
        self._verify: DecodeStep | None | bool = False  # its two-row form (MTP's verification), on first use
        self._parts: dict[tuple[int, int, bool], DecodeStep | None] = {}  # steps over parts: `part_step`
        self._sequences: dict[int, DecodeStep | None] = {}  # per batch size: the step over that many sequences
        # the MTP acceptance below which drafting decodes slower than single tokens on the device step, where
        # measured (`Engine.use_mtp`): a generation turns MTP off once its first drafts fall below it
        self.mtp_break_even: float | None = None
        self.layers = [layer_spec(config, i, weights.has) for i in range(config.num_layers_with_mtp)]

    def _w(self, name: str) -> Weight:
        return self.weights.weight(name)

    def _norm(self, x: np.ndarray, norm: NormSpec) -> np.ndarray:
        """`x [S, n]` through the RMSNorm (or LayerNorm, with a bias) `norm`."""
        if norm.bias is None:
            return self.backend.rms_norm(x, self._w(norm.weight), norm.eps)
        return self.backend.layer_norm(x, self._w(norm.weight), self._w(norm.bias), norm.eps)

    @property
    def has_mtp(self) -> bool:
        """True when the weights include the MTP layer (index num_hidden_layers)."""
        return self.config.num_nextn_predict_layers > 0 and self.weights.has(mtp_spec(self.config).eh_proj)

    def new_cache(self) -> KVCache:
        """An empty cache; indexer keys are kept on every layer that has an indexer."""
        return KVCache(self.config, index_layers=[s.index for s in self.layers if s.attention.indexer is not None],
                       dtype=self.kv_dtype)

    # ---- entry points --------------------------------------------------------------------------

    def forward(self, token_ids: np.ndarray, cache: KVCache, last_logits_only: bool = False
                ) -> tuple[np.ndarray, np.ndarray]:
        """Append `token_ids [S]` at positions `cache.length..` and run the main model.

        Returns (logits `[S, V]`, or `[1, V]` for the last position with `last_logits_only`;
        hidden `[S, H]` after the final norm, the input the MTP layer needs).
        """
        if cache.length + len(token_ids) > self._held_kv_rows:  # a caller that did not say (`hold_kv_rows`): at
            self.hold_kv_rows(cache.length + len(token_ids))  # least this sequence's rows
        x = self.embed(token_ids)
        # asked for before any prefill: a discrete device's step places its weights (and what is left of the budget
        # for routed experts) before per-operation calls upload weights as they come
        step = self._decode_step()
        if len(token_ids) == 1 and cache.length > 0 and step is not None:
            return self._device_decode(int(token_ids[0]), x[0], cache)
        if len(token_ids) == VERIFY_ROWS and cache.length > 0 and self._verify_step() is not None:
            logits, hidden = self._device_verify(x, cache)
            return (logits[-1:] if last_logits_only else logits), hidden
        hidden = self.final_norm(self.main_layers(x, cache))
        head_in = hidden[-1:] if last_logits_only else hidden
        logits = self.backend.linear(head_in, self._w(LM_HEAD))
        if len(token_ids) > self.absorb_max_rows:
            self.backend.release_memory()  # a prefill's temporaries are freed; decode should not carry them
        return logits, hidden

    def decode_batch(self, token_ids: np.ndarray, caches: Sequence[KVCache]) -> tuple[np.ndarray, np.ndarray]:
        """One new token for each of B sequences in one forward: `token_ids[i]` appended to `caches[i]` (B different
        caches, each already holding rows) at its own length. Attention runs per sequence (its cache, its DSA
        selection); norms, projections, MLPs, the router and lm_head on the B rows at once. Where single tokens decode
        on the device step, the batch is one forward of its form over B sequences (`sequences_step`: each row's
        logits bit for bit its sequence's on the single-row step; each row runs its own expert slots), else through
        the operations (the routed MoE runs each expert any row routes to once for the batch). Returns (logits
        `[B, V]`, hidden `[B, H]` after the final norm); one sequence goes through `forward` (the device decode step
        where there is one)."""
        if not self.batches_sequences:
            raise GlmkitError("this model runs one sequence per forward (its layers' rows are not all in this process)")
        if len(caches) != len(token_ids) or len({id(cache) for cache in caches}) != len(caches):
            raise ValueError(f"decode_batch: {len(token_ids)} tokens for {len(caches)} caches (one each, all distinct)")
        if len(caches) == 1:
            return self.forward(np.asarray(token_ids), caches[0])
        step = self._decode_step()
        if step is not None:
            step.settle()  # a pipelined single-token forward in flight finishes before its cache is read
        x = self.embed(token_ids)  # [B, H]
        rows_step = self.sequences_step(len(caches)) if all(cache.length > 0 for cache in caches) else None
        if rows_step is not None:
            logits, hidden, routes = rows_step.decode_rows(caches, x)
            self._report_routes(routes)
            return logits, hidden
        chosen: list[ChosenKeys] = [None] * len(caches)
        for layer in range(self.config.num_hidden_layers):
            kvs = [cache.layer(layer) for cache in caches]
            attend = functools.partial(self.batch_attention, layer, kvs=kvs, prev_chosen=chosen)
            x, chosen = self._residual_block(layer, x, attend)
        hidden = self.final_norm(x)
        return self.backend.linear(hidden, self._w(LM_HEAD)), hidden

    def pipelined_batch(self, token_ids: Sequence[int], caches: Sequence[KVCache],
                        draws: Sequence[TokenDraws | None] | None = None) -> PipelinedRows | None:
        """Decoding of B sequences (B >= 2), each appending `token_ids[i]` to `caches[i]` first, with the next batch's
        forward queued before the host sees the tokens (`DecodeStep.pipeline_rows`): each row's tokens those of
        `decode_batch` and the argmax, or of the host sampler `draws[i]` (its seeded stream used as the host would).
        None where the model has no such step (then `decode_batch`)."""
        if not self.batches_sequences or len(caches) < 2 or not all(cache.length > 0 for cache in caches):
            return None
        step = self.sequences_step(len(caches))
        if step is None:
            return None
        single = self._decode_step()
        if single is not None:
            single.settle()  # a pipelined single-token forward in flight finishes before its cache is read
        return step.pipeline_rows(caches, token_ids, lambda ids: self.embed(np.asarray(ids)), self._report_routes,
                                  draws)

    def batch_pays(self) -> bool:
        """Whether decoding several sequences through `decode_batch` can beat one forward each: where single tokens run
        through the operations (NumPy), or where they decode on a device step whose form over several sequences binds
        (`sequences_step`; whether it is faster there is measured: `Engine.use_batching`). Not where only the device
        step's single-row form does: the batch's per-operation forward is then slower than a step per sequence
        (docs/BENCHMARKS.md, "Continuous batching")."""
        return self.batches_sequences and (not self.decodes_on_device() or self.sequences_step(2) is not None)

    def sequences_step(self, count: int) -> DecodeStep | None:
        """The decode step's form over `count` sequences (`DecodeStep.decode_rows`), built on first use for that
        count and kept (a batch grows and shrinks as requests come and go); None where single tokens do not decode
        on the device step or the backend has no such form (e.g. an expert cache too small for the rows, the split
        step)."""
        if count not in self._sequences:
            self._sequences[count] = (self._new_step(rows=count, sequences=True)
                                      if self._decode_step() is not None else None)
        return self._sequences[count]

    def prefill_on_step(self, token_ids: np.ndarray, cache: KVCache, queued: bool = True
                        ) -> tuple[np.ndarray, np.ndarray]:
        """Append `token_ids [S]` at `cache.length..` through the device decode step (`decodes_on_device`; the first
        token of an empty cache as a one-row forward): the forwards queued back to back, the lm_head for the last one
        only, where the step looks embeddings up itself (`DecodeStep.prompt`), two tokens per forward where its
        two-row form runs (the single-row step for an odd token first); else (or without `queued`: tools/bench.py
        compares the two) one `forward` per token, waiting for its logits. Returns (the last position's logits
        `[1, V]`, hidden `[S, H]` after the final norm), bit for bit those of one `forward` per token."""
        hidden = []
        if cache.length == 0:
            logits, first = self.forward(token_ids[:1], cache)
            hidden.append(first)
            token_ids = token_ids[1:]
        two_rows = self._verify_step() if queued and len(token_ids) >= VERIFY_ROWS else None
        odd = len(token_ids) % VERIFY_ROWS if two_rows is not None else len(token_ids)
        done = 0
        for step, ids in ((self._decode_step(), token_ids[:odd]), (two_rows, token_ids[odd:])):
            if not queued or step is None or not len(ids):
                continue
            self._step.settle()  # a pipelined forward in flight on the single-row step finishes first
            last = done + len(ids) == len(token_ids)
            ran = step.prompt(cache, ids, logits=last)
            if ran is None:
                break
            if last:
                logits = ran[0]
            _, rows, routes = ran
            self._report_routes(routes)
            hidden.append(rows)
            done += len(ids)
        for token in token_ids[done:]:
            logits, h = self.forward(token[None], cache)  # [1, V], [1, H]
            hidden.append(h)
        return logits, np.concatenate(hidden)

    def prompt_chunk(self, chunk: int, held_rows: int | None = None) -> int:
        """Prompt rows per forward for a caller that would take `chunk`: fewer where memory is tight
        (`prefill_rows`); where prompts run layer by layer, a whole span (`span_rows`), since each forward then
        reads every routed expert its rows route to once, lengthened by the room kept for KV rows
        (`kv_room_tokens`) that the `held_rows` the caller's sequences may come to hold leave unused."""
        if self.span_rows is None:
            return chunk if self.prefill_rows is None else min(chunk, self.prefill_rows)
        if self.kv_room_tokens is None or held_rows is None:
            return self.span_rows
        spare = max(0, self.kv_room_tokens - held_rows) * self._kv_row_bytes
        return self.span_rows + spare // self._span_row_bytes

    @property
    def _span_row_bytes(self) -> int:
        """The bytes a span run layer by layer holds per row at its peak (SPAN_ROW_FLOATS)."""
        return self.config.hidden_size * 4 * SPAN_ROW_FLOATS

    def hold_kv_rows(self, rows: int) -> None:
        """The KV rows the caller's sequences may come to hold from now on (as `prompt_chunk`'s `held_rows`): an
        expert cache that lends their room (`lend_hook`) gives back their bytes first. Call it before they grow
        (`forward` raises it to its own sequence's rows where a caller did not)."""
        self._held_kv_rows = rows
        self._lend()

    def _lend(self, span_bytes: int = 0) -> None:
        """Tell `lend_hook` the bytes of the rows held (`hold_kv_rows`) and `span_bytes` more for a span."""
        if self.lend_hook is not None:
            self.lend_hook(self._held_kv_rows * self._kv_row_bytes + span_bytes)

    def main_layers(self, x: np.ndarray, cache: KVCache) -> np.ndarray:
        """Every decoder layer of the main model on the embedded rows `x [S, H]` of the tokens appended at
        `cache.length..`; returns the last layer's output `[S, H]` (before the final norm)."""
        positions = np.arange(cache.length, cache.length + len(x))
        layers = range(self.config.num_hidden_layers)
        if self.span_rows is not None and self.prefill_rows is not None and len(x) > self.prefill_rows:
            # a span lengthened by the KV rows' room (`prompt_chunk`) takes that room from a cache it was lent to
            longer = max(0, len(x) - self.span_rows) * self._span_row_bytes
            if longer:
                self._lend(longer)
            try:
                return self.layers_by_layer(layers, x, positions, cache, self.prefill_rows)
            finally:
                if longer:
                    self._lend()
        return self.run_layers(layers, x, positions, cache, None)[0]

    def layers_by_layer(self, layers: range, x: np.ndarray, positions: np.ndarray, cache: KVCache, block: int
                        ) -> np.ndarray:
        """`run_layers` of a prompt's rows `x [S, H]` at `positions [S]` (from layer 0), one layer at a time: the
        layer's attention `block` rows at a time in order (a block's queries see the rows of the blocks before it,
        as chunked prefill's do), then its feed-forward on all S rows at once, so that its MoE runs each routed
        expert once for the whole span where chunks would read it once per chunk. Returns `[S, H]`; the logits
        are a single forward's within f32 rounding (blocks of attention instead of one)."""
        x = np.array(x, dtype=np.float32)  # [S, H], the residual stream, updated block by block
        blocks = row_blocks(len(x), block)
        chosen: list[np.ndarray | None] = [None] * len(blocks)  # each block's DSA selection, for 'shared' layers
        for layer in layers:
            kv = cache.layer(layer)
            for i, rows in enumerate(blocks):
                x[rows], chosen[i] = self._attention_residual(
                    layer, x[rows], functools.partial(self.attention, layer, positions=positions[rows], kv=kv,
                                                      prev_chosen=chosen[i]))
            x = self._feed_forward_residual(layer, x)
        return x

    def run_layers(self, layers: range, x: np.ndarray, positions: np.ndarray, cache: KVCache,
                   chosen: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """The decoder layers `layers` in order on `x [S, H]` at `positions [S]`; chosen: the DSA selection `[S, K]`
        of the 'full' layer before them, reused by a leading 'shared' layer (None at layer 0). Returns (the last
        layer's output `[S, H]`, the selection the next layer would reuse)."""
        for layer in layers:
            x, chosen = self.decoder_layer(layer, x, positions, cache.layer(layer), chosen)
        return x, chosen

    def part_step(self, layers: range, logits: bool) -> DecodeStep | None:
        """The backend's decode step over a part of the model, built on first use: a pipeline stage's `layers` (its
        hidden state in and out, no logits), or none of them with `logits` (a pipeline head's final norm and lm_head);
        None: single tokens run through the operations."""
        key = (layers.start, layers.stop, logits)
        if key not in self._parts:
            self._parts[key] = self._new_step(span=layers, logits=logits)
        return self._parts[key]

    def step_layers(self, layers: range, x: np.ndarray, cache: KVCache, chosen: np.ndarray | None
                    ) -> tuple[np.ndarray, np.ndarray | None] | None:
        """`run_layers` of one token `x [1, H]` appended to layers that already hold rows, as one device step over
        `layers` (`part_step`: a pipeline stage's part of a decoded token); None where the backend has no such step."""
        step = self.part_step(layers, False)
        if step is None:
            return None
        out, chosen, routes = step.run_span(cache, x, chosen)
        self._report_routes(routes)
        return out, chosen

    @property
    def numerics(self) -> str:
        """The arithmetic the KV rows are computed in (the prefix cache's key): the backend's `numerics`."""
        return self.backend.numerics

    def decodes_on_device(self) -> bool:
        """Whether a single-token forward runs as the backend's decode step (e.g. OpenCL on a CPU device)."""
        return self._decode_step() is not None

    def _decode_step(self) -> DecodeStep | None:
        if self._step is False:
            self._step = self._new_step()
        return self._step

    def _new_step(self, rows: int = 1, draft: tuple[LayerSpec, MTPSpec] | None = None, span: range | None = None,
                  logits: bool = True, sequences: bool = False) -> DecodeStep | None:
        """The backend's decode step over the main layers in one of its forms (`Backend.decode_step`), its routing
        watched by `step_route_hook` where it runs any layer; None where the backend has no such form."""
        cfg = self.config
        mtp = (self.layers[cfg.num_hidden_layers], mtp_spec(cfg)) if self.has_mtp else None
        step = self.backend.decode_step(cfg, self.layers[:cfg.num_hidden_layers], self._w, self.step_experts,
                                        self.kv_dtype, rows=rows, draft=draft, span=span, logits=logits,
                                        sequences=sequences, mtp=mtp)
        if step is not None and self.step_route_hook is not None and (span is None or span):
            step.watch_routes(self.step_route_hook)
        return step

    def _verify_step(self) -> DecodeStep | None:
        """The decode step's form over VERIFY_ROWS token rows (a token and MTP's draft in one forward), built on
        first use where the single-token step runs; None: such forwards run operation by operation."""
        if self._verify is False:
            self._verify = None
            if self._decode_step() is not None:
                cfg = self.config
                draft = (self.layers[cfg.num_hidden_layers], mtp_spec(cfg)) if self.has_mtp else None
                self._verify = self._new_step(VERIFY_ROWS, draft)
        return self._verify

    def drafts_on_device(self) -> bool:
        """Whether MTP's verification of a draft and the MTP head's next draft run as one device step
        (`verify_draft`)."""
        step = self._verify_step()
        return step is not None and step.drafts()

    def _device_verify(self, x: np.ndarray, cache: KVCache) -> tuple[np.ndarray, np.ndarray]:
        """The tokens of embedding rows `x [VERIFY_ROWS, H]` through the two-row decode step."""
        logits, hidden, _ = self._verify_rows(x, cache, False)
        return logits, hidden

    def _verify_rows(self, x: np.ndarray, cache: KVCache, choose: bool
                     ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
        """`DecodeStep.verify` of the embedding rows `x`, after any pipelined single-token forward in flight
        finished (the two steps share the device's queue and the cache)."""
        step = self._verify_step()
        assert step is not None
        self._step.settle()
        logits, hidden, routes, drafted = step.verify(cache, x, choose)
        self._report_routes(routes)
        return logits, hidden, drafted

    def verify_draft(self, token_ids: np.ndarray, cache: KVCache, greedy: bool
                     ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
        """MTP's verification forward of `token_ids` ([the last token, its draft]) on the device step
        (`drafts_on_device`), and when `greedy` in the same queue the MTP head on each row's greedy token: (logits
        `[2, V]`, hidden `[2, H]`, (each row's greedy token, the draft after it; the MTP layer's rows appended for
        both) or None). Without `greedy` the host chooses the tokens and `redraft` drafts."""
        return self._verify_rows(self.embed(token_ids), cache, greedy)

    def redraft(self, token_ids: list[int], hidden: np.ndarray, cache: KVCache) -> np.ndarray:
        """The MTP head's greedy drafts `[2]` on the device step after verified rows of main hidden states `hidden
        [2, H]` and the tokens chosen for them (`[2]`); the MTP layer's rows are appended from its length (the
        verified rows' first position)."""
        step = self._verify_step()
        assert step is not None
        self._step.settle()
        return step.redraft(cache, token_ids, hidden)

    def _device_decode(self, token: int, embed: np.ndarray, cache: KVCache) -> tuple[np.ndarray, np.ndarray]:
        """One decoded token through the backend's decode step; the route hook sees each layer's experts after
        the token ran (no normed input: nothing is left to prefetch for)."""
        logits, hidden, routes = self._step(token, cache, embed)
        self._report_routes(routes)
        return logits, hidden

    def _report_routes(self, routes: Routes) -> None:
        """Hand the route hook the experts a device decode step chose, after the token ran."""
        if self.route_hook is not None:
            for layer, ids in routes:
                self.route_hook(layer, ids, None)

    def pipelined_decode(self, token: int, cache: KVCache, draws: TokenDraws | None = None,
                         constraint: TokenMask | None = None) -> PipelinedDecode | None:
        """Decoding from `token` (appended next) with the following forward queued before the host sees each
        token (the backend's decode step): greedy, or each token drawn on the device as the sampler `draws` would
        draw it, among those `constraint` allows (it has taken `token`, and takes each token returned); None: the
        caller then decodes with `forward`."""
        step = self._decode_step() if cache.length > 0 else None
        if step is None:
            return None
        return step.pipeline(token, cache, lambda t: self.embed(np.array([t]))[0], draws, self._report_routes,
                             constraint)

    def mtp_forward(self, hidden: np.ndarray, next_token_ids: np.ndarray, cache: KVCache
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Multi-token prediction: draft logits for the token after each `next_token_ids[i]`.

        hidden `[S, H]`: the main model's post-final-norm states at positions p..p+S-1 (p = the MTP
        layer's cache length); next_token_ids `[S]`: the tokens at positions p+1..p+S.
        `h' = eh_proj([enorm(emb(t_{i+1})) ; hnorm(h_i)])` (embedding first), then the MTP decoder layer
        at position i, `shared_head.norm` and the main `lm_head`.
        Returns (logits `[S, V]`, the MTP layer's output `[S, H]` before `shared_head.norm`).
        """
        cfg = self.config
        if cfg.num_nextn_predict_layers == 0:
            raise GlmkitError("this model has no MTP layer (num_nextn_predict_layers is 0)")
        layer, mtp = cfg.num_hidden_layers, mtp_spec(cfg)
        joined = np.concatenate([self._norm(self.embed(next_token_ids), mtp.enorm), self._norm(hidden, mtp.hnorm)],
                                axis=-1)  # [S, 2H]
        x = self.backend.linear(joined, self._w(mtp.eh_proj))  # [S, H]
        kv = cache.layer(layer)
        x, _ = self.decoder_layer(layer, x, np.arange(kv.length, kv.length + len(x)), kv, None)
        return self.backend.linear(self.mtp_head_input(x), self._w(LM_HEAD)), x

    def mtp_head_input(self, x: np.ndarray) -> np.ndarray:
        """lm_head's input `[S, H]` in the MTP head: `shared_head.norm` of the MTP layer's output `x [S, H]`."""
        return self._norm(x, mtp_spec(self.config).head_norm)

    # ---- the layer math, at explicit positions ----------------------------------------------------

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        """Embedding rows `[S, H]` float32 of `token_ids [S]`."""
        return embed_rows(self._w(EMBED), np.asarray(token_ids))

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        """The main model's final RMSNorm of the last layer's output `x [S, H]` (the lm_head's and MTP's input)."""
        return self._norm(x, final_norm_spec(self.config))

    def decoder_layer(self, layer: int, x: np.ndarray, positions: np.ndarray, kv: LayerKV,
                      prev_chosen: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """`h = x + Attn(RMSNorm(x))`; `x' = h + FFN(RMSNorm(h))` for the rows `x [S, H]` of the tokens at
        `positions [S]` (see `attention` for how their cache rows are written). Returns (x' `[S, H]`, the DSA
        selection `[S, K]` it attended with, or None)."""
        return self._residual_block(layer, x, lambda u: self.attention(layer, u, positions, kv, prev_chosen))

    def _residual_block(self, layer: int, x: np.ndarray, attend: Callable[[np.ndarray], tuple[np.ndarray, Selection]]
                        ) -> tuple[np.ndarray, Selection]:
        """`h = x + attend(RMSNorm(x))`; `x' = h + FFN(RMSNorm(h))` on `x [S, H]`, the attention `attend(u)` -> (output
        `[S, H]`, the selection it used): one sequence's (`decoder_layer`) or one row per sequence (`decode_batch`)."""
        h, chosen = self._attention_residual(layer, x, attend)
        return self._feed_forward_residual(layer, h), chosen

    def _attention_residual(self, layer: int, x: np.ndarray,
                            attend: Callable[[np.ndarray], tuple[np.ndarray, Selection]]
                            ) -> tuple[np.ndarray, Selection]:
        """The layer's first half: (`h = x + attend(RMSNorm(x))` `[S, H]`, the selection the attention used)."""
        attn, chosen = attend(self._norm(x, self.layers[layer].input_norm))
        return x + attn, chosen  # [S, H]

    def _feed_forward_residual(self, layer: int, h: np.ndarray) -> np.ndarray:
        """The layer's second half: `h += FFN(RMSNorm(h))` `[S, H]`, in place (no second `[S, H]` beside it)."""
        h += self.feed_forward(layer, self._norm(h, self.layers[layer].post_attention_norm))
        return h

    def attention(self, layer: int, u: np.ndarray, positions: np.ndarray, kv: LayerKV,
                  prev_chosen: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """MLA + DSA on normed input `u [S, H]` of the tokens at `positions [S]` (strictly increasing).

        Their cache rows are appended when the positions continue the cache (`kv.length..`), else written in
        place over rows already there; each query then attends to the cached rows at or before its own
        position: all of them, or DSA's top-k (`select_keys`), gathered per query. Returns (output `[S, H]`, the
        selection `[S, K]` this layer attended with, or None for every causal key).
        """
        spec = self.layers[layer].attention
        seq, start = u.shape[0], kv.length
        appending = seq > 0 and positions[0] == start and positions[-1] == start + seq - 1
        cos, sin = rope_cos_sin(positions, spec.rope, spec.rope_theta)  # [S, rope/2] each
        a = self.attention_inputs(layer, u, cos, sin, self._scored(layer, start + seq if appending else start))
        out, chosen = self._attend_cached(layer, a, positions, kv, prev_chosen, appending)
        return self.backend.linear(out.reshape(seq, -1), self._w(spec.o_proj)), chosen

    def _scored(self, layer: int, total: int) -> bool:
        """Whether layer `layer`'s indexer scores keys for queries that see `total` cached rows (with at most topk
        keys it keeps them all: no scores)."""
        indexer = self.layers[layer].attention.indexer
        return indexer is not None and total > indexer.topk

    def batch_attention(self, layer: int, u: np.ndarray, kvs: Sequence[LayerKV], prev_chosen: Sequence[ChosenKeys]
                        ) -> tuple[np.ndarray, list[ChosenKeys]]:
        """`attention` of one new token per sequence: row i of normed input `u [B, H]` appended to `kvs[i]` at its
        length. The projections run on the B rows at once; each row writes, selects (DSA, against its own indexer
        keys) and attends over its own cache. Returns (output `[B, H]`, each row's selection `[1, K]` or None)."""
        spec = self.layers[layer].attention
        positions = np.array([kv.length for kv in kvs])
        cos, sin = rope_cos_sin(positions, spec.rope, spec.rope_theta)  # [B, rope/2] each
        scored = [self._scored(layer, kv.length + 1) for kv in kvs]
        a = self.attention_inputs(layer, u, cos, sin, any(scored))
        outs, chosen = [], []
        for i, kv in enumerate(kvs):
            row = slice(i, i + 1)
            own = AttentionInputs(a.q_nope[row], a.q_rot[row], a.kv_lat[row], a.k_rot[row],
                                  None if a.index_k is None else a.index_k[row],
                                  None if a.index_q is None or not scored[i] else a.index_q[row],
                                  None if a.index_weights is None or not scored[i] else a.index_weights[row])
            out, keys = self._attend_cached(layer, own, positions[row], kv, prev_chosen[i], True)
            outs.append(out)
            chosen.append(keys)
        return self.backend.linear(np.concatenate(outs).reshape(len(kvs), -1), self._w(spec.o_proj)), chosen

    def _attend_cached(self, layer: int, a: AttentionInputs, positions: np.ndarray, kv: LayerKV,
                       prev_chosen: ChosenKeys, appending: bool) -> tuple[np.ndarray, ChosenKeys]:
        """The cache side of `attention` for one sequence's rows `a` at `positions [S]`: write their cache rows
        (appended, or over rows already there), choose their keys, attend. Returns (`[S, nh, v]`, the selection)."""
        spec = self.layers[layer].attention
        seq, start = len(positions), kv.length
        rows = {"kv_lat": a.kv_lat, "k_rot": a.k_rot}
        if spec.indexer is not None:
            rows["index_k"] = a.index_k
        if appending:
            kv.append(**rows)
        else:
            kv.overwrite(positions, **rows)
        chosen = self.select_keys(layer, a, kv, positions, prev_chosen)  # [S, K] or None
        if chosen is not None:  # sparse: latent form, K gathered rows per query
            out = mla_attend_absorbed(self.backend, a.q_nope, a.q_rot, kv.kv_lat, kv.k_rot, self._w(spec.kv_b),
                                      chosen, spec.scale)  # [S, nh, v]
        else:
            absorb = appending and 0 < start and seq <= self.absorb_max_rows
            attend = mla_attend_absorbed if absorb else mla_attend_full
            out = attend(self.backend, a.q_nope, a.q_rot, kv.kv_lat, kv.k_rot, self._w(spec.kv_b),
                         position_mask(positions, kv.length), spec.scale)  # [S, nh, v]
        return out, chosen

    def kv_latent(self, layer: int, x: np.ndarray) -> np.ndarray:
        """The normed latent `kv_lat [S, kv_lora_rank]` layer `layer` caches for rows whose layer input is
        `x [S, H]` (input_layernorm -> kv_a_proj_with_mqa -> kv_a_layernorm); for layer 0, a function of the
        token alone."""
        return self._kv_compress(self.layers[layer].attention, self._norm(x, self.layers[layer].input_norm))[0]

    def _kv_compress(self, spec: AttentionSpec, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """kv_a_proj_with_mqa of normed input `u [S, H]`: (`kv_lat [S, kv_lora_rank]` after kv_a_layernorm, the
        shared key `[S, rope]` before rope)."""
        compressed = self.backend.linear(u, self._w(spec.kv_a))  # [S, kvl + rope]
        return self._norm(compressed[:, :spec.kv_lora], spec.kv_a_norm), compressed[:, spec.kv_lora:]

    def attention_inputs(self, layer: int, u: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                         scored: bool) -> AttentionInputs:
        """Every projection layer `layer`'s attention needs from its normed input `u [S, H]` (see
        `AttentionInputs`); the indexer key when the layer has an indexer, its queries and head weights when
        `scored`."""
        b, spec = self.backend, self.layers[layer].attention
        seq = u.shape[0]
        q_lat = self._norm(b.linear(u, self._w(spec.q_a)), spec.q_a_norm)  # [S, q_lora]
        q = b.linear(q_lat, self._w(spec.q_b)).reshape(seq, spec.heads, spec.nope + spec.rope)
        kv_lat, k_pre = self._kv_compress(spec, u)
        inputs = AttentionInputs(q[..., :spec.nope], b.rope(q[..., spec.nope:], cos, sin), kv_lat,  # rope: LAST dims
                                 b.rope(k_pre, cos, sin))
        ix = spec.indexer
        if ix is not None:  # indexer: LayerNorm with bias on the key, rope on the FIRST rope dims
            key = self._norm(b.linear(u, self._w(ix.wk)), ix.key_norm)  # [S, ihd]
            inputs.index_k = np.concatenate([b.rope(key[:, :spec.rope], cos, sin), key[:, spec.rope:]], axis=-1)
        if scored:
            assert ix is not None
            iq = b.linear(q_lat, self._w(ix.wq_b)).reshape(seq, ix.n_heads, ix.head_dim)
            inputs.index_q = np.concatenate([b.rope(iq[..., :spec.rope], cos, sin), iq[..., spec.rope:]], axis=-1)
            inputs.index_weights = b.linear(u, self._w(ix.weights_proj)) * np.float32(ix.head_scale)  # [S, inh]
        return inputs

    def select_keys(self, layer: int, inputs: AttentionInputs, kv: LayerKV, positions: np.ndarray,
                    prev_chosen: np.ndarray | None) -> np.ndarray | None:
        """The keys `[S, K]` int32 (-1 padded) the queries at `positions` attend to: DSA's top-k when the layer's
        indexer scored (`inputs.index_q`, against all cached indexer keys), the previous layer's selection on a
        'shared' layer; None: every causal key."""
        spec = self.layers[layer].attention
        if inputs.index_q is not None:
            assert inputs.index_weights is not None and spec.indexer is not None
            return self.backend.index_topk(inputs.index_q, kv.index_k, inputs.index_weights, spec.indexer.score_scale,
                                           positions, spec.indexer.topk)
        if spec.selection == "previous":
            return prev_chosen  # the previous layer's top-k, reused
        return None

    # ---- feed-forward --------------------------------------------------------------------------

    def feed_forward(self, layer: int, u: np.ndarray) -> np.ndarray:
        """Layer `layer`'s feed-forward `[S, H]` on its normed input `u [S, H]`: the MoE on MoE layers, else
        the dense MLP."""
        ffn = self.layers[layer].ffn
        if isinstance(ffn, MoESpec):
            return self._moe(ffn, u)
        if self.ahead_hook is not None:
            self.ahead_hook(layer, u)
        mlp = self._mlp(ffn)
        if u.shape[0] <= DENSE_MLP_ROWS:
            return self.backend.expert_mlp(u, *mlp)
        out = np.empty_like(u)  # [S, H]; row blocks bound the [rows, I] intermediates of a long prompt
        for rows in row_blocks(u.shape[0], DENSE_MLP_ROWS):
            out[rows] = self.backend.expert_mlp(u[rows], *mlp)
        return out

    def _mlp(self, spec: MLPSpec) -> tuple[Weight, Weight, Weight]:
        """(gate, up, down) weights of an MLP."""
        gate, up, down = (self._w(name) for name in spec.names)
        return gate, up, down

    def _moe(self, spec: MoESpec, u: np.ndarray) -> np.ndarray:
        """Routed experts (batch-union) plus the shared expert, on `u [S, H]`. A long prompt's router and shared
        expert run in row blocks (their `[rows, E]` and `[rows, I]` temporaries bounded), the routed experts on all
        rows at once (each read once); the shared expert's rows are added last, as the backends add them."""
        r = spec.router
        blocks = row_blocks(u.shape[0], DENSE_MLP_ROWS)
        routes = [route_noaux_tc(self.backend.linear(u[rows], self._w(r.weight)), self._w(r.bias), r.top_k, r.n_group,
                                 r.topk_group, r.norm_topk_prob, r.scaling) for rows in blocks]  # ([s, k], [s, k])
        ids, weights = (np.concatenate(parts) for parts in zip(*routes, strict=True))  # [S, k] each
        if self.route_hook is not None:
            self.route_hook(spec.layer, ids, u)
        done = None if self.ran_hook is None else functools.partial(self.ran_hook, spec.layer)
        shared = None if spec.shared is None else self._mlp(spec.shared)
        if len(blocks) == 1 or shared is None:
            return self.backend.moe(u, ids, weights, lambda e: self._mlp(spec.expert(e)), shared, done)
        out = self.backend.moe(u, ids, weights, lambda e: self._mlp(spec.expert(e)), None, done)  # [S, H]
        for rows in blocks:
            out[rows] += self.backend.expert_mlp(u[rows], *shared)
        return out
