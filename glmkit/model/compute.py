"""What the model asks of a compute backend: every heavy operation of the forward pass, as one protocol.

The model (`glmkit.model.glm5`) only calls the methods of `Backend`, so the OpenCL backend can replace
`NumpyBackend` (the reference) without the model changing. Activations are float32 NumPy arrays; a weight is
either a float32 `[O, I]` array or a `QuantWeight` viewed in place from the container.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import numpy as np

from glmkit.format.config import ModelConfig
from glmkit.format.tensors import Weight
from glmkit.model.kv_cache import KVCache
from glmkit.model.layer_spec import LayerSpec, MTPSpec
from glmkit.model.ops import moe_batch_union

ExpertFn = Callable[[int], tuple[Weight, Weight, Weight]]
"""`expert(e)` -> routed expert e's (gate, up, down) weights."""

class Backend(Protocol):
    """The operations the model needs; shapes use S = query rows, T = keys, nh = heads.

    `numerics` names the kernels' arithmetic: KV rows computed under one value are only reused (prefix
    cache) under the same value, so it must change whenever a kernel change can change KV values.
    """

    numerics: str

    def linear(self, x: np.ndarray, w: Weight) -> np.ndarray:
        """`x [S, I] @ w[O, I]^T -> [S, O]`."""
        ...

    def head_matmul(self, x: np.ndarray, w: Weight, row_start: int, rows: int, transpose: bool) -> np.ndarray:
        """Per-head products with row blocks of `w` (MLA's absorbed `kv_b`).

        `w [nh * R, I]` holds nh blocks of R rows; head h uses `B_h = w[h*R + row_start : ... + rows]`
        (`[rows, I]`). `x [S, nh, K]` -> `x[:, h] @ B_h^T` (K = I, result `[S, nh, rows]`), or with
        `transpose` `x[:, h] @ B_h` (K = rows, result `[S, nh, I]`).
        """
        ...

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """`weight * x / sqrt(mean(x^2) + eps)` over the last axis."""
        ...

    def layer_norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
        """`(x - mean) / sqrt(var + eps) * weight + bias` over the last axis (biased variance)."""
        ...

    def expert_mlp(self, x: np.ndarray, gate: Weight, up: Weight, down: Weight) -> np.ndarray:
        """`x [n, H]` -> `down(silu(gate x) * up x)` `[n, H]`."""
        ...

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray,
                  scale: float) -> np.ndarray:
        """Masked softmax attention.

        q `[S, nh, dk]`; k `[T, kh, dk]` and v `[T, kh, dv]` with kh = nh or kh = 1 (one key/value head
        shared by all query heads); allowed `[S, T]` bool (every row has at least one True).
        Returns `[S, nh, dv]` = `softmax(q.k * scale, masked) @ v` per head, in float32.
        """
        ...

    def attention_chosen(self, q: np.ndarray, k: tuple[np.ndarray, ...], v: np.ndarray, chosen: np.ndarray,
                         scale: float) -> np.ndarray:
        """Softmax attention of each query over its own chosen keys only (DSA's sparse attention).

        q `[S, nh, dk]`; k: the keys `[T, kh, dk]` as column parts `[T, kh, dk_i]` (joined only for the rows a query
        gathers: MLA's latent and rope parts stay apart), v `[T, kh, dv]` as in `attention`; chosen `[S, K]` int32
        key indices (-1: none; every row names at least one key). Returns `[S, nh, dv]`: `attention` with the mask of
        the chosen keys, without an `[S, T]` matrix or a copy of the keys: the work grows with S x K, not S x T.
        """
        ...

    def index_topk(self, q: np.ndarray, k: np.ndarray, weights: np.ndarray, scale: float, positions: np.ndarray,
                   topk: int) -> np.ndarray:
        """DSA selection: per query the `min(topk, positions[s] + 1)` largest DSA indexer scores among its causal
        keys `0..positions[s]` (`topk_mask` of the scores), the scores of q `[S, nh, d]`, k `[T, d]`, weights
        `[S, nh]` being `I[s, t] = sum_h weights[s, h] * relu(q[s, h] . k[t] * scale)`. Returns the chosen keys
        `[S, topk]` int32 (`chosen_keys`: ascending, -1 padded); scores are made a block of queries at a time
        (never `[S, T]` at once)."""
        ...

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """RoPE over the whole last axis of `x [S, ..., d]` with the angles of row S (`apply_rope`)."""
        ...

    def moe(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, expert: ExpertFn,
            shared: tuple[Weight, Weight, Weight] | None, done: Callable[[int], None] | None = None) -> np.ndarray:
        """Routed experts plus the shared expert on `x [S, H]`.

        `sum_k weights[s, k] * E_{ids[s, k]}(x[s]) + Shared(x[s])`; `expert(e)` gives expert e's (gate, up,
        down). Every routed expert is fetched and run once per call, on all of its rows (batch-union). `done(e)`,
        where given, may be called as soon as expert e's weights are no longer read (a prompt's experts, one by one).
        """
        ...

    def release_memory(self) -> None:
        """Hand memory freed since the last call back to the OS (the model calls it after a prefill)."""
        ...

    def decode_step(self, config: ModelConfig, layers: Sequence[LayerSpec], weight: Callable[[str], Weight],
                    experts: ExpertArena | None = None, kv_dtype: str = "f32", rows: int = 1,
                    draft: tuple[LayerSpec, MTPSpec] | None = None, span: range | None = None,
                    logits: bool = True, sequences: bool = False, mtp: tuple[LayerSpec, MTPSpec] | None = None
                    ) -> DecodeStep | None:
        """A whole forward of `rows` consecutive tokens (1: a decoded token; 2: MTP's verification of a draft) of the
        main model, whose decoder layers `layers` describes, in one call (`DecodeStep`), or None: the model then
        runs them through the operations above. experts: where the routed experts are read from instead of `weight`
        (an expert cache's slots, filled as each layer routes); kv_dtype: the precision of the cache rows it reads
        and writes; draft: the MTP layer and head, for a verification step that also drafts (`verify`).
        span: the layers it runs (default all: a pipeline stage's range, `run_span`; none: only the final norm and
        lm_head, a pipeline head's); logits: whether the final norm's output goes through lm_head (not on a stage).
        A step of a part of the model takes one token row and no draft. sequences: the rows are as many sequences,
        each appended to its own cache (`DecodeStep.decode_rows`: continuous batching). mtp: the model's MTP layer and
        head, whatever the form (a step that keeps weights within a budget keeps room for them)."""
        ...


class ExpertArena(Protocol):
    """Routed experts in equal slots of one RAM arena, filled as layers route (`glmkit.model.expert_cache`): what a
    decode step needs to read them in place."""

    arena: np.ndarray  # uint8, slot s at [s * slot_bytes, (s + 1) * slot_bytes)
    slot_bytes: int
    n_slots: int  # the routed experts' slots (the pinned shared experts' follow them)
    place_table: np.ndarray  # int64 [layers * experts], page-aligned: where each read expert starts (-1: not read)

    @property
    def slot_count(self) -> int: ...

    def slot_weights(self, layer: int, slot: int) -> list[Weight]: ...

    def uniform_layout(self, layer: int) -> bool: ...

    def shared_slot(self, layer: int) -> int | None: ...

    def on_route(self, layer: int, expert_ids: np.ndarray, normed: np.ndarray | None = None) -> None: ...

    def read_ahead(self, layer: int, normed: np.ndarray) -> None: ...

    def wait_places(self, layer: int, experts: list[int]) -> list[int]: ...

    def hold_elsewhere(self, keys: Iterable[tuple[int, int]]) -> None: ...


Routes = list[tuple[int, np.ndarray]]
"""`(layer, expert ids [1, k])` of every MoE layer of one token."""


class SamplingSettings(Protocol):
    """A sampler's settings, as `glmkit.generate.sampling.SamplingParams` holds them."""

    temperature: float
    top_k: int  # 0: off
    top_p: float  # 1: off


class TokenDraws(Protocol):
    """A host sampler as a device that draws its tokens sees it: the settings, the seeded stream (one uniform per
    token, in order) and the host's token for given logits `[V]` and uniform (where the device cannot decide)."""

    params: SamplingSettings
    rng: np.random.Generator

    def pick(self, logits: np.ndarray, u: float) -> int: ...


class TokenMask(Protocol):
    """A constraint on the tokens as a device that masks the logits itself sees it: the tokens allowed next as a
    bitmask (bit t % 32 of int32 word t // 32), told each token chosen (`accept`; `rollback` takes back the last
    ones)."""

    def allowed_bits(self) -> np.ndarray: ...

    def accept(self, token: int) -> None: ...

    def rollback(self, tokens: int) -> None: ...


class PipelinedDecode(Protocol):
    """Decoding with the next forward queued ahead: `advance()` returns each next token."""

    ahead: int  # cache rows past the last token returned (dropped by `close`)
    stopped: bool  # no forward is queued ahead any more: the caller decodes one token at a time from here

    def advance(self) -> int: ...

    def close(self) -> None: ...


class PipelinedRows(Protocol):
    """A batch of sequences decoded with the next forward queued ahead: `advance()` returns each row's next token;
    `close()` drops the rows of the forward in flight."""

    running: bool  # a forward is in flight (else `advance` may not be called: closed, or stopped)

    def advance(self) -> list[int]: ...

    def close(self) -> None: ...


class DecodeStep(Protocol):
    def __call__(self, token: int, cache: KVCache, embed: np.ndarray) -> tuple[np.ndarray, np.ndarray, Routes]:
        """Append `token` (embedding row `embed [H]`; a step of R rows: R tokens' embeddings `[R, H]`) at
        `cache.length`: (logits `[R, V]`, hidden `[R, H]` after the final norm, the routes)."""
        ...

    def prompt(self, cache: KVCache, token_ids: Sequence[int], logits: bool = True
               ) -> tuple[np.ndarray | None, np.ndarray, Routes] | None:
        """Append `token_ids [S]` (S a multiple of the step's rows), R per forward, the forwards queued without
        waiting for each other's results, the lm_head for the last only (none without `logits`): (the last token's
        logits `[1, V]` or None, hidden `[S, H]`, the routes); None where not supported."""
        ...

    def pipeline(self, token: int, cache: KVCache, embed_of: Callable[[int], np.ndarray],
                 draws: TokenDraws | None = None, on_routes: Callable[[Routes], None] | None = None,
                 constraint: TokenMask | None = None) -> PipelinedDecode | None:
        """Decoding from `token` (the next forward appends its row): greedy, or drawn as `draws` draws, among the
        tokens `constraint` allows; None where not supported."""
        ...

    def watch_routes(self, hook: Callable[[int, np.ndarray], None]) -> None:
        """Call `hook(layer, expert ids [k])` as each MoE layer routes, before its experts run (any thread)."""
        ...

    def settle(self) -> None:
        """Let a pipelined forward in flight finish (another forward is about to use the cache)."""
        ...

    def run_span(self, cache: KVCache, x: np.ndarray, chosen: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray | None, Routes]:
        """A step bound to a span of layers without logits (a pipeline stage's): the hidden state `x [1, H]` entering
        them and the DSA selection `chosen [1, K]` of the layer before them (or None) -> (the hidden state after the
        last one `[1, H]`, the selection a following 'previous' layer reuses or None, the routes)."""
        ...

    def decode_rows(self, caches: Sequence[KVCache], embed: np.ndarray) -> tuple[np.ndarray, np.ndarray, Routes]:
        """A step of R sequences: token row r (embedding `embed[r]`, `[R, H]`) appended to `caches[r]` at its own
        length: (logits `[R, V]`, hidden `[R, H]` after the final norm, the routes)."""
        ...

    def pipeline_rows(self, caches: Sequence[KVCache], tokens: Sequence[int],
                      embed_of: Callable[[Sequence[int]], np.ndarray],
                      on_routes: Callable[[Routes], None] | None = None,
                      draws: Sequence[TokenDraws | None] | None = None) -> PipelinedRows | None:
        """A step of R sequences decoding from `tokens[r]` (the next forward appends their rows) with the following
        forward queued ahead, each row greedily or drawn as `draws[r]` draws; None where it cannot. embed_of(tokens):
        their embedding rows `[R, H]`."""
        ...

    def verify(self, cache: KVCache, embed: np.ndarray, choose: bool
               ) -> tuple[np.ndarray, np.ndarray, Routes, tuple[np.ndarray, np.ndarray] | None]:
        """A step of R rows: the tokens of embeddings `embed [R, H]` appended at `cache.length`, with `choose` also
        MTP's drafts: (logits `[R, V]`, hidden `[R, H]`, routes, (each row's greedy token, the MTP head's greedy
        draft after it) or None)."""
        ...

    def redraft(self, cache: KVCache, tokens: Sequence[int], hidden: np.ndarray) -> np.ndarray:
        """The MTP head's greedy drafts `[R]` after verified rows of main hidden states `hidden [R, H]` and the
        tokens chosen for them (the MTP layer's rows appended from its length)."""
        ...

    def drafts(self) -> bool:
        """Whether `verify` and `redraft` can run the MTP head (a step of R > 1 rows bound with it)."""
        ...


def moe_layer(backend: Backend, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, expert: ExpertFn,
              shared: tuple[Weight, Weight, Weight] | None,
              parallel_map: Callable[[Callable, list], list] | None = None, chunk: int = 1,
              done: Callable[[int], None] | None = None) -> np.ndarray:
    """`Backend.moe` on top of any backend's `expert_mlp`: the routed experts by batch-union (`chunk` at a time
    through `parallel_map` when given, `done(e)` after each), plus the shared expert. `[S, H]`."""
    out = moe_batch_union(x, ids, weights, lambda e, rows: backend.expert_mlp(rows, *expert(e)), parallel_map, chunk,
                          done)
    if shared is not None:
        out += backend.expert_mlp(x, *shared)
    return out
