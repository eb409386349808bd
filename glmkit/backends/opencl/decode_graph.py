"""The device decode step: one decoded token of the main model as a single queue of OpenCL kernels.

The OpenCL backend answers each operation with a host array, so a decoded token makes ~80 host round trips,
and on a CPU device every one of them wakes the device's sleeping worker threads. Here the whole token -
norms, projections, RoPE, the indexer's scores and top-k, absorbed MLA attention, noaux_tc routing, the fused
experts, the residual adds and the lm_head - is enqueued back to back on buffers that stay put, and the host
waits once, for the logits. Each layer's launches are bound from its description (`glmkit.model.layer_spec`: the
stages, their tensors and constants, as `GlmMoeDsaModel.decoder_layer` runs them); a layer whose description holds
something these kernels do not do is refused (`Unsupported`). The math is the model's for one token (same order of
operations; float sums may associate differently, as in every kernel), except that by default the int4
products (int3 too), and a q4/q3/q2 model's int8 ones, take int8-quantized inputs (`_int8_input_bits`, common.cl).
Every launch costs the device some idle time, so work is merged where it reads the same input
or is small: two products of the normed hidden state in one launch (`_matvec_pair`), a product that writes its
output's int8 codes (`codes_out`), the token's cache rows and query latent in one launch (`token_rows`), the
query's absorption with its RoPE (`mla_query`), and the experts' per-slot down rows summed by the next residual
norm (`Addend`).

On `direct` devices (CPU OpenCL devices such as PoCL's, whose buffers are host memory) the kernels write each
layer's new KV row straight into the host `KVCache` arrays, so prefill, MTP, truncation and the prefill cache all
see the same rows. Rows kept at a lower precision (`--kv-dtype` bf16, f16 or fp8) are read as the codes they are
stored in by kernels built for them (kv.cl), and each new row is computed in f32 and stored by `kv_store_rows`,
rounded as the host rounds it (`encode_kv_rows`). On discrete devices (a GPU with memory of its own; every weight
must fit its budget) the step's buffers are device memory: the cache rows live in a device copy (`KVMirrors`) that
takes the rows the host wrote since (`LayerKV.edited_from`), and each token's new rows, its logits (or greedy
token) and routed ids are copied back with non-blocking reads behind its kernels. A layer's experts may lie in
several weight buffers (the files of the mapping: a GLM-5 layer outgrows one 4 GB file): the routing kernel fills the
slots of each buffer, and each gets its own fused launches. A discrete device that holds every weight but some routed
experts runs those on a CPU OpenCL device beside it (`SpillDevice`, the split step: one host wait per MoE layer).
`OpenCLBackend.decode_step` builds the step, or returns None when a weight or an expert cannot be used in place or
placed on the device (the per-operation path runs then).

MTP's verification of a draft runs as the same step bound for two token rows (`rows=2`, over the mapping or an
expert cache's slots; on a discrete device each row's cache rows are staged for the read back): the weight products
take both rows, the kernels that work per token a row each (a work-group or a global dimension per row), attention
with each row's causal keys, and with `draft` the MTP layer and head after them in the same queue, from each row's
greedy token (`verify`), or from the host's tokens (`redraft`).

Continuous batching runs the same step bound for B token rows of B different sequences (`sequences`, `decode_rows`):
what works on the rows' values takes the B rows in one launch, as for MTP's rows; what reads or writes a cache runs
once per row (the row's launch at a global offset, `Launch.at_row`) on that row's own cache, position and key count
(on a discrete device: the sequence's one device copy of its cache, `KVMirrors`, and its own rows of the staged
KV rows read back).

Pipelined decoding (`DecodePipeline`) also chooses the token and looks up the next embedding on the device, so that
the next token's forward is queued before the host has seen this one: the device does not wait for the host
between tokens. The token is the argmax (`ArgmaxChoice`, greedy) or drawn with temperature, top-k and top-p from
a uniform the host drew in advance from its sampler's seeded stream (`SampledChoice`, sample.cl: the host's token
for the same seed; where the device cannot decide within float64 rounding, the host chooses from the logits and
the forward queued after it is redone). Buffers that a queued token and the one in flight would share are kept
per turn (TURNS of them, of which a pipeline alternates two, its token parity; the routed expert ids: per token,
in ID_SLOTS turns, for the route watcher).

A short prompt's tokens (`prompt`) are forwards of the step too, `rows` tokens each, queued back to back: the host
writes each forward's token ids for the device's embedding lookup and waits only for the forward TURNS before it,
whose turn the next one takes (with several rows the causal mask is kept per turn too); the forwards before the
last skip the lm_head, their final norm writing their rows of the prompt's hidden states (read back once).
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from glmkit.backends.opencl.buffers import DeviceArray, Int8Codes, address
from glmkit.backends.opencl.decode_launches import (
    ExpertSlots,
    bind_embed_row,
    bind_expert_sum,
    bind_experts,
    bind_experts_x8,
    bind_matvec,
    bind_matvec_pair,
    bind_matvec_t,
    bind_matvec_x8,
    bind_mla_query,
    bind_quantize,
)
from glmkit.backends.opencl.kv_mirrors import KVMirrors
from glmkit.backends.opencl.ops import Kernels
from glmkit.backends.opencl.program import Launch
from glmkit.backends.opencl.weights import X8_BLOCK, ClWeight, fused_expert_arrays, mvt_chunked, x8_eligible
from glmkit.format.config import ModelConfig
from glmkit.format.tensors import Weight
from glmkit.model.compute import ExpertArena, SamplingSettings, TokenDraws, TokenMask
from glmkit.model.expert_cache import ExpertScores
from glmkit.model.kv_cache import SCALED_KV_DTYPES, SHADOW_BLOCK, KVCache, LayerKV, shadow_bound
from glmkit.model.layer_spec import (
    EMBED,
    LM_HEAD,
    IndexerSpec,
    LayerSpec,
    MLPSpec,
    MoESpec,
    MTPSpec,
    NormSpec,
    final_norm_spec,
)
from glmkit.model.ops import rope_cos_sin

MAX_ROUTED_EXPERTS = 1024  # the routing kernel's private arrays (MAX_EXPERTS in decode.cl)
MAX_EXPERT_BUFFERS = 8  # weight buffers one layer's experts may span (MAX_BUFFERS in decode.cl)
MAX_TOPK = 64  # experts one token routes to, for the slot placement (MAX_TOPK in decode.cl)
SAMPLE_CANDIDATES = 1024  # the most candidates (top_k + 1) sample_token sorts (SAMPLE_CANDIDATES in sample.cl)
FALLBACK_SHARE = 8  # a sampled pipeline gives way to the host path once over 1 in 8 tokens were the host's choice
ID_SLOTS = 32  # routed-id buffers per MoE layer, used in turn by successive tokens: the watcher's callbacks may lag
TURNS = 4  # forwards queued at once, each with buffers of its own (a pipeline alternates two, a prompt uses all)
INITIAL_KEYS = 1024  # keys the per-key scratch buffers hold at first (they double as the context grows)
KEY_GROUP = 16  # work-group size of the kernels with one work-item per key
MAX_INDEX_HEADS = 64  # indexer heads index_shadow_scores holds the query norms of (MAX_INDEX_HEADS in indexer.cl)
SHADOW_GROUP = 8  # work-group size of index_shadow_scores (a work-item per block of SHADOW_BLOCK keys)
SHADOW_MIN_KEYS = 16384  # the shadow selection runs from this many keys on (below it the one-stage one is as fast)
SHADOW_MIN_PER_KEPT = 16  # and from this many keys per key it keeps (index_topk), blocks enough for its threshold
LISTED_SHARE = 4  # more listed keys than one in this many: the shadow selection rescores every key
LISTED_ITEMS = 32 * KEY_GROUP  # work-items of index_scores_listed: a few listed keys each, few idle work-groups
SHADOW_FIELDS = ("index_k.shadow", "index_k.shadow_scale")  # the cache's shadow arrays as `_cache_buffer` names them
NO_STAGE = 0xFFFFFFFF  # token_rows: no staging copy of the cache rows (decode.cl)
UNUSED_SLOT = 0xFFFFFFFF  # the token of an expert slot a launch skips (quant.cl)
# a sequences step's launches that read or write a token row's cache, each run per row (`Launch.at_row`): the _Layer
# attributes (each kernel counts its token rows along its last global dimension)
PER_ROW = ("rows", "store", "shadow", "scores", "topk", "shadow_scores", "candidates", "rescore", "select",
           "attention", "values")
SLOT_ARRAYS = {"offs": (6, np.uint64), "slot_w": (1, np.float32), "slot_tok": (1, np.uint32),
               "tok_start": (1, np.uint32)}  # what routing writes per expert slot: values per slot, type


class Unsupported(Exception):
    """The device decode step cannot run this model on this device (the per-operation path is used)."""


class Addend(NamedTuple):
    """What a residual norm adds to x (buffers): the sum over rows s in [range[0], range[1]) of weights[s] * rows[s].
    A layer's routed experts leave their per-slot down outputs and routing weights so (the next norm sums them, no
    launch of their own); any other addend is one row of weight 1."""

    rows: Any
    range: Any
    weights: Any

    def args(self) -> dict[str, Any]:
        """As residual_rms_norm's arguments."""
        return {"a": self.rows, "a_range": self.range, "a_w": self.weights}


class RouteWatcher:
    """Hands each MoE layer's routed expert ids to `hook(layer, ids [k])` as its routing launch completes, while
    the device goes on: the experts can be read ahead (madvise) before their kernels fault them in, which pays
    where the model is larger than RAM (docs/BENCHMARKS.md). Through OpenCL event callbacks: a helper thread
    waiting on the events runs only after decoding has finished."""

    def __init__(self, kernels: Kernels, hook: Callable[[int, np.ndarray], None]) -> None:
        self.kernels, self.hook = kernels, hook

    def watch(self, event: Any, layer: int, ids: np.ndarray) -> None:
        """Call the hook with `ids` (a host array the launch of `event` writes) once that launch completed."""
        self.kernels.on_complete(event, lambda: self.hook(layer, ids.copy()))


def index_topk(layers: Sequence[LayerSpec]) -> int:
    """The keys the indexers keep (the first indexer's `topk`; 1 where no layer has one)."""
    return next((spec.attention.indexer.topk for spec in layers if spec.attention.indexer is not None), 1)


def check_bindable(layers: Sequence[LayerSpec]) -> None:
    """Raise `Unsupported` unless every stage of these main layers is one the decode step's kernels do: one shared
    RoPE and key count, one epsilon for the latent norms (`token_rows` normalizes them together), RMSNorms around
    the attention, and a 'previous' selection only after a layer with an indexer (the kernels reuse its choice)."""
    if not layers:
        raise Unsupported("a model without decoder layers")
    first, indexed, topk = layers[0].attention, False, index_topk(layers)
    for spec in layers:
        a = spec.attention
        where = f"layer {spec.index}"
        if (a.rope, a.rope_theta, a.heads) != (first.rope, first.rope_theta, first.heads):
            raise Unsupported(f"{where}: RoPE or heads differ from layer {layers[0].index}'s")
        eps = {a.q_a_norm.eps, a.kv_a_norm.eps} | ({a.indexer.key_norm.eps} if a.indexer is not None else set())
        if len(eps) != 1 or a.q_a_norm.bias or a.kv_a_norm.bias:
            raise Unsupported(f"{where}: latent norms the token_rows kernel does not compute")
        if spec.input_norm.bias or spec.post_attention_norm.bias:
            raise Unsupported(f"{where}: a LayerNorm around the attention")
        if a.indexer is not None and (a.indexer.key_norm.bias is None or a.indexer.head_dim < a.rope):
            raise Unsupported(f"{where}: an indexer key the token_rows kernel does not compute")
        if a.indexer is not None and a.indexer.topk != topk:
            raise Unsupported(f"{where}: its indexer keeps another number of keys than the first one's")
        if a.selection == "causal" or (a.selection == "previous" and not indexed):
            raise Unsupported(f"{where}: a {a.selection!r} selection (the kernels reuse the last indexer's choice)")
        indexed |= a.indexer is not None


class _Staged(NamedTuple):
    """Discrete devices: rows of a forward's staged KV rows (`row_stage`) that belong to one cache: its token rows
    first_row.. (`count` of them) at positions pos.., of `layers` ((index, bound launches) of each)."""

    cache: KVCache
    pos: int
    first_row: int
    count: int
    layers: list[tuple[int, _Layer]]


class _ArenaLayer(NamedTuple):
    """A MoE layer whose routed experts lie in an expert cache's slots. Its routing (`route_arena`) fills the fused
    launches' slots of the experts already read (`first`: per arena chunk, each slot's token row where that chunk's
    first launch set computes it); the host fills those of the rest once they are read (`offs`: 6 byte offsets per
    slot, `rel` from where the expert starts, within its chunk; `after`: as `first`, for the launch sets queued after
    the reads). Row t's members (its routed experts, then its shared one where that lies in the arena) in slots
    t * members.., the shared one's placed once."""

    layer: int
    rows: int
    top_k: int
    members: int
    rel: np.ndarray  # uint64 [6]
    offs: DeviceArray  # uint64 [rows * members * 6]
    first: DeviceArray  # uint32 [chunks * stride]
    after: DeviceArray
    stride: int


class SpillDevice(NamedTuple):
    """A CPU OpenCL device beside a discrete one (the backend's `spill`): its kernels and its fused-expert view of
    (gate, up, down) in place over the mapping (`OpenCLBackend._expert_ref`'s, or None); and the routed experts'
    usage scores (`ExpertScores`, or None): the most used go to the discrete device, and each decoded token's
    routes count."""

    kernels: Kernels
    expert_ref: Callable
    usage: ExpertScores | None = None


class _SplitLayer:
    """A MoE layer whose routed experts lie partly in the discrete device's memory and partly on the CPU device
    (`SpillDevice`). Routing fills one slot per routed expert (the shared one last) as over the whole model; per
    token the host reads the ids, masks each slot to the launches that compute it (`masks`, one per device buffer
    holding resident experts: `sets`), and the CPU device computes the other slots' rows from the same input,
    uploaded into the same per-slot rows (`part`): the next norm sums them in slot order."""

    def __init__(self, layer: int, views: list[tuple[Weight, Weight, Weight]], cpu_refs: list, shape: Any, top_k: int,
                 members: int, rows: int, table: DeviceArray, regions: dict[str, DeviceArray],
                 scratch: tuple[DeviceArray, Any], shared: Any, cpu_rel: np.ndarray | None) -> None:
        self.layer = layer  # the decoder layer's index
        self.views, self.cpu_refs, self.shape, self.top_k, self.members = views, cpu_refs, shape, top_k, members
        self.rows = rows  # token rows: row t's slots are t * members.. (its routed experts, then the shared one)
        # with an expert cache: the CPU side's experts lie in its slots, laid out as `cpu_rel` (uint64 [6]) from a
        # slot's start; `cpu_refs` then holds the fused view of slot 0 for every expert (its scheme and shape)
        self.cpu_rel = cpu_rel
        self.table, self.regions, self.hid, self.part = table, regions, *scratch
        self.shared = shared  # the shared expert's device view (resident), or None
        self.resident: list[Any] = [None] * len(views)  # per routed expert: its device view, or None (CPU side)
        self.where = np.full(len(views), -1, np.int64)  # per routed expert: its launch set (`sets`), -1: CPU side
        self.masks: list[DeviceArray] = []  # per launch set: the slot tokens it runs (the row) or skips (UNUSED_SLOT)
        self.shared_set = -1  # the launch set that computes the shared expert's slot (run every token)
        self.sets: list[list[Launch]] = []  # per device buffer holding resident experts: the fused launches
        self.cpu_sets: dict[int, tuple[DeviceArray, list[Launch]]] = {}  # per CPU-side buffer: slot tokens, launches
        self.cpu_offs: DeviceArray | None = None  # the CPU side's slot offsets (rows x members x 6)
        self.cpu_part: DeviceArray | None = None  # the CPU side's per-slot down rows (rows x members x n_in)
        # a shared expert of another scheme than the routed ones: the routed slots' sum, then its launches and sum
        self.after: list[Launch] = []


class _Layer:
    """One decoder layer's bound launches, by name those whose arguments change per token (cache rows, key
    count, turn)."""

    def __init__(self) -> None:
        self.head: list[Launch] = []  # from the input norm to the query's absorption (always)
        self.scoring: list[Launch] = []  # indexer queries, scores, top-k (only with more than index_topk keys)
        self.tail: list[Launch] = []  # attention, output projection, FFN
        self.rows: Launch | None = None  # writes kv_lat[row], k_rot[row], index_k[row] and the query latent
        self.store: Launch | None = None  # at a lower precision: stores the rows `rows` wrote in f32
        # the cache arrays its kernels read: its fields' rows, and at fp8 their scales (`{field}.scale`)
        self.cache_fields: tuple[str, ...] = ()
        self.scores: Launch | None = None
        self.topk: Launch | None = None
        # the shadow selection (CPU devices): the new keys' shadows (in `head`), then the launches that replace
        # `scores` and `topk` in `shadowed` once the keys are many (`DeviceDecodeStep.shadow_selects`)
        self.shadow: Launch | None = None
        self.shadowed: list[Launch] = []
        self.shadow_scores: Launch | None = None
        self.candidates: Launch | None = None
        self.rescore: Launch | None = None
        self.select: Launch | None = None
        self.attention: Launch | None = None  # scores, then softmax and values
        self.values: Launch | None = None
        self.route: Launch | None = None
        self.ids: list[DeviceArray] = []  # MoE layers, per token slot: the routed expert ids
        self.arena: _ArenaLayer | None = None  # experts in an expert cache's slots: what the host places per token
        self.split: _SplitLayer | None = None  # routed experts partly on a CPU device beside a discrete one
        self.after_route: list[Launch] = []  # with `arena`: the launches queued once the host placed the experts
        self.after_misses: list[list[Launch]] = []  # with `arena`, per arena chunk: those run once misses are read
        self.cache_buffers: dict[str, DeviceArray] = {}  # direct devices: field -> its storage array and buffer
        # a sequences step (`DeviceDecodeStep.decode_rows`): per token row, this layer with that row's own launches of
        # PER_ROW (`seqs`); `head` and `tail` with those launches row by row (`rows_head`, `rows_tail`); the indexer
        # query's launches, run once for every row
        self.seqs: list[_Layer] = []
        self.rows_head: list[Launch] = []
        self.rows_tail: list[Launch] = []
        self.query: list[Launch] = []


class _Draft(NamedTuple):
    """MTP's draft of the rows a verification forward just ran (`DeviceDecodeStep.draft`): the greedy token of each
    row (`choose`, into `verified`), their embeddings (`lookup`), `eh_proj` of the normed embeddings and main hidden
    states (`head`), the MTP decoder layer, then its head norm, the lm_head and each row's greedy draft (`tail`)."""

    choose: Launch
    lookup: Launch
    head: list[Launch]
    layer: _Layer
    tail: list[Launch]


class DeviceDecodeStep:
    """`step(token, cache, embed) -> (logits [1, V], hidden [1, H], routes)` for a token appended at
    `cache.length` (embed: its embedding row `[H]`); `step.pipeline(...)` decodes with the next forward
    in flight.

    routes: `(layer, expert ids [1, k])` of each MoE layer, read back after the token ran (for the route hook).
    Built once per model and backend; raises `Unsupported` when some weight cannot be used in place.

    experts: the routed experts lie in an expert cache's slots (`ExpertArena`, read by a CPU device: this one, or
    with `spill` the split step's CPU side, for the experts it runs). Each MoE layer's routing (`route_arena`) then
    places the experts already read from the cache's place table, and their launches follow it in the queue; the
    host waits for the routing, hands the routed ids to the cache (`on_route`: its misses are read), names the next
    layer's likely experts to it (`read_ahead`), waits for the rest and queues their launches over the same slots.
    The slots' bytes are the container's and are summed in slot order: the logits are those of the step on the
    mapping (bit for bit where the mapping holds a layer's experts in one buffer, however many buffers the arena
    spans). routes are then [] (the cache saw them as they happened). Greedy
    decoding is pipelined as on the mapping: the next token's forward is queued up to its first MoE layer's
    routing while this one finishes, so the device does not wait for the host between tokens.

    rows: token rows per forward (consecutive positions; 2: MTP's verification of [token, draft], `verify`; over an
    expert cache, one whose slots hold every row's routed experts at once: each MoE layer's host wait places the
    union of the rows' experts, each read once). Each row's logits, hidden state and KV rows
    are bit for bit those of the single-row step fed the same tokens. draft: (the MTP layer's description, the MTP
    head's): `verify` then also drafts in the same queue.

    sequences: the token rows are as many different sequences, row r appended to its own cache at its own length
    (`decode_rows`: continuous batching). Norms, products, RoPE, routing, the experts and the lm_head take the rows
    at once (the routed experts' slots per row, as for `rows`); each launch that reads or writes a cache (its new rows,
    the indexer's scores and top-k, attention: `PER_ROW`) runs once per row, bound to that row's cache, position and
    key count (`Launch.at_row`). Each row's logits are bit for bit the single-row step's for its sequence alone.

    mirrors: a discrete device's copies of the KV rows (`KVMirrors`), shared by the steps of one backend: each
    sequence's rows have one copy on the device, whichever step and token row use them.

    spill: a CPU OpenCL device beside a discrete one that cannot hold every routed expert (the split step: see
    `_bind_split_moe`, `_place_split`, `_run_split`): the experts the budget leaves out run there, each MoE layer's
    host wait bringing their input back and their per-slot rows over. The logits are the whole-model step's, bit for
    bit where both devices run the same build of the expert kernels. The whole model, in every form (token rows of
    one sequence, MTP's draft, several sequences: each row's experts in slots of its own on both sides); with `experts`
    the CPU side's experts come from the cache (`_run_split`), the device's never read into it (`hold_elsewhere`).
    mtp: the model's MTP layer and head, whose weights but the routed experts a split step uploads before the routed
    experts take the rest of the budget (the device's weights are its backend's, shared by its steps), so that the
    verification's form, built later, binds them.

    span: the main layers bound (default all; `layers` always describes them all: the numerics and the indexers' key
    count are the model's). A pipeline stage's step (`logits` False) takes the hidden state entering its first layer
    in `x` and leaves the one after its last in `x` (`run_span`: the final norm's launch adds the last FFN output into
    it); the head's (no layers, `logits`) runs the final norm and lm_head on the last stage's hidden state. Each
    launch is the whole step's, so the parts chained give its logits bit for bit (the next part's first norm reads
    the sum the previous part's last norm wrote).
    """

    def __init__(self, cfg: ModelConfig, layers: Sequence[LayerSpec], weight: Callable[[str], Weight],
                 cw: Callable[[Weight], ClWeight | None], expert_ref: Callable, kernels: Kernels,
                 int8_activations: bool = True, experts: ExpertArena | None = None, kv_dtype: str = "f32",
                 rows: int = 1, draft: tuple[LayerSpec, MTPSpec] | None = None, span: range | None = None,
                 logits: bool = True, spill: SpillDevice | None = None, sequences: bool = False,
                 mirrors: KVMirrors | None = None, mtp: tuple[LayerSpec, MTPSpec] | None = None) -> None:

        if cfg.n_routed_experts > MAX_ROUTED_EXPERTS:
            raise Unsupported(f"{cfg.n_routed_experts} routed experts (the routing kernel holds {MAX_ROUTED_EXPERTS})")
        check_bindable(layers if draft is None else [*layers, draft[0]])
        span = range(len(layers)) if span is None else span
        whole = span == range(len(layers)) and logits
        if not whole and (rows > 1 or draft is not None):
            raise Unsupported("a part of the model (a pipeline stage's layers, or its head): one token row, no draft")
        if draft is not None and (rows < 2 or any(n.bias for n in (draft[1].enorm, draft[1].hnorm,
                                                                     draft[1].head_norm))):
            raise Unsupported("MTP's draft: in a verification step (rows > 1) of an MTP head with RMSNorms")
        if spill is not None and (kernels.direct or not whole):
            raise Unsupported("routed experts on a CPU device beside: a discrete device's whole-model step")
        if sequences and (rows < 2 or draft is not None):
            raise Unsupported("a step of several sequences: several rows, no draft")
        self.sequences = sequences
        self.mirrors = KVMirrors(kernels.buffers) if mirrors is None else mirrors  # shared by a backend's steps
        self.draft_spec = draft
        # the model's main layers (numerics, RoPE, the indexers' key count), and those this step runs: `span`
        self.cfg, self.model_specs, self.k, self.buffers = cfg, list(layers), kernels, kernels.buffers
        self.span, self.specs = span, list(layers[span.start:span.stop])
        self.kv_dtype = kv_dtype
        self.rows = rows
        self.topk = index_topk(layers)
        # the two-stage selection from the keys' shadows (exact, DESIGN section 3, "DSA indexer"): CPU devices, where
        # its single-item kernels run well and the cache arrays are read in place. Set False, the step selects in one
        # stage over all keys (the shadows are still written): tools/bench_long.py's comparison
        self.shadow_selects = kernels.direct and kernels.lanes == 1 and cfg.index_n_heads <= MAX_INDEX_HEADS
        self._weight, self._cw, self._expert_ref = weight, cw, expert_ref
        self.experts = experts
        self.spill = spill
        self.split_input: tuple[tuple[Any, DeviceArray], ...] = ()  # spill: (device buffer, CPU array) to copy
        if experts is not None:  # the arena in chunks no larger than one buffer may be, slot-aligned
            # read in place by a CPU device: this one, or the split step's CPU side (`spill`)
            arena_buffers = kernels.buffers if spill is None else spill.kernels.buffers
            if spill is None and not kernels.direct:
                raise Unsupported("an expert cache's slots are read in place: CPU OpenCL devices only")
            if experts.n_slots < rows * cfg.num_experts_per_tok:  # every row's routed experts at once
                raise Unsupported(f"{rows} token rows over an expert cache of {experts.n_slots} slots")
            self.chunk_slots = max(1, arena_buffers.max_alloc // experts.slot_bytes)
            n, size, per = experts.slot_count, experts.slot_bytes, self.chunk_slots
            self.chunks = [arena_buffers.read_only_in_place(experts.arena[s * size:min(n, s + per) * size])
                           for s in range(0, n, per)]
            if spill is not None and len(self.chunks) > MAX_EXPERT_BUFFERS:  # the step's own: a launch set per chunk
                raise Unsupported(f"the expert cache's arena spans {len(self.chunks)} device buffers")
            # where each read expert lies, as the cache keeps it: `route_arena` reads it (the split step's host does)
            self.place_table = arena_buffers.read_only_in_place(experts.place_table)
        self.x8_bits = self._int8_input_bits(int8_activations)
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        nope, rope, v_dim, kvl = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.red = kernels.red_lanes
        self._vectors = self._pack_vectors()

        def new(count: int, dtype: Any = np.float32) -> DeviceArray:  # one row per token row of a forward
            return self.buffers.array(rows * count, dtype)

        self.x, self.u, self.ffn, self.ffn_part = new(h), new(h), new(h), new(h)
        # per turn (forwards queued while earlier ones run, `TURNS`): cos/sin, the token the device chose (or the
        # host wrote for it to look up) and whether the host must choose instead (1: sample_token could not decide)
        self.cs = [new(rope) for _ in range(TURNS)]
        # (each token row's token, then each row's flag)
        self.token_ids = [self.buffers.array(2 * rows, np.uint32) for _ in range(TURNS)]
        # discrete devices, per turn: every layer's new cache rows ([kv_lat | k_rot | index_k] per token row, the MTP
        # layer's last; token_rows writes them) for one read back, and where they belong until `_collect` stores them
        # there
        self.stage_fields = {"kv_lat": kvl, "k_rot": rope, "index_k": cfg.index_head_dim}  # name -> width
        self.stage_width = sum(self.stage_fields.values())
        self.row_stage = [self.buffers.array(cfg.num_layers_with_mtp * rows * self.stage_width)
                          for _ in range(TURNS)]
        self.staged: list[list[_Staged]] = [[] for _ in range(TURNS)]
        self._cs_users: list[Launch] = []  # every launch that reads the position's cos/sin (its argument `cs`)
        self.q_a, self.q_lat = new(cfg.q_lora_rank), new(cfg.q_lora_rank)
        # int8 codes of the normed inputs, written by the norms themselves for the int8-input products
        self.u_x8, self.q_lat_x8, self.hidden_x8 = (
            self._x8_scratch(rows * n) if self.x8_bits and n % X8_BLOCK == 0 else None
            for n in (h, cfg.q_lora_rank, h))
        self.q = new(nh * (nope + rope))
        self.comp = new(kvl + rope)
        self.q_rot, self.q_abs, self.o_lat = new(nh * rope), new(nh * kvl), new(nh * kvl)
        self.heads_out, self.attn_out = new(nh * v_dim), new(h)
        self.hidden = new(h)
        self.logits = new(self._matrix(LM_HEAD).rows) if logits else None
        ihd, inh = cfg.index_head_dim, cfg.index_n_heads
        self.key_raw, self.key = new(ihd), new(ihd)
        # a lower precision's new cache rows in f32, as token_rows computes them (kv_store_rows stores them)
        self.new_rows = None if kv_dtype == "f32" else {"kv_lat": new(kvl), "k_rot": new(rope), "index_k": new(ihd)}
        self.iq, self.iq_rot, self.iw = new(inh * ihd), new(inh * ihd), new(inh)
        self.chosen = new(self.topk, np.uint32)  # the keys the indexer chose (attention's keys)
        # the ranges and weights of an addend of one row (of weight 1) per token row
        self.one_range = self.buffers.filled(np.arange(rows + 1), np.uint32)
        self.one_weight = self.buffers.filled(np.ones(rows))
        self.ffn_out = self._whole(self.ffn)  # the last bound layer's FFN output, as the next norm adds it
        self.capacity = 0  # keys the per-key scratch buffers hold
        # each MoE layer's routed ids, per token slot in one buffer (one read per token on a discrete device)
        n_moe = sum(cfg.is_moe_layer(spec.index) for spec in (*self.specs, *(draft[:1] if draft else ())))
        self.id_stride = self.buffers.aligned_items(rows * cfg.num_experts_per_tok)
        self.route_ids = [self.buffers.array(max(n_moe, 1) * self.id_stride, np.uint32) for _ in range(ID_SLOTS)]
        self.scratch: dict[str, DeviceArray] = {}
        # several token rows, per turn: the causal mask (`allowed[turn]`) and the keys it holds at 0
        self.allowed: list[DeviceArray] = []
        self.masked: list[list[int]] = [[] for _ in range(TURNS)]
        self.layers: list[_Layer] = []
        self.draft: _Draft | None = None
        self._grow(INITIAL_KEYS)
        for spec in self.specs:
            self.layers.append(self._bind_layer(spec))
            if sequences:
                self._bind_row_views(self.layers[-1])
        # after the last layer, the residual add into x (the hidden state a pipeline stage hands on) and the final norm
        self.final_norm = self._norm(self.x, self.ffn_out if self.specs else None, final_norm_spec(cfg), self.hidden,
                                     h, self.hidden_x8)
        # a prompt's forward but its last: the final norm into its rows of the prompt's hidden states (`prompt`), no
        # lm_head after it (y and y_off set per forward)
        self.kept_norm = self._norm(self.x, self.ffn_out if self.specs else None, final_norm_spec(cfg), self.hidden, h)
        self.kept: DeviceArray | None = None  # those hidden states `[S - rows, H]`, grown as needed
        self.lm_head: Launch | None = None
        self.argmax: Launch | None = None
        self.embed: Launch | None = None
        # what the host reads of a forward: the logits and the final norm's output, or a pipeline stage's hidden
        # state and the selection a following 'previous' layer reuses
        self.outputs = (self.x, self.chosen) if self.logits is None else (self.logits, self.hidden)
        if self.logits is not None:
            (self.lm_head,) = self._matvec(self._matrix(LM_HEAD), self.hidden, self.logits, quantized=self.hidden_x8)
            argmax_rows = rows if sequences else 1  # each sequence's greedy token (`pipeline_rows`)
            self.argmax = kernels.bind("argmax_row", (self.red, argmax_rows), (self.red, 1), x=self.logits.buffer,
                                       n=self.logits.host.size // rows, token=self.token_ids[0].buffer)
            embed = self._cw(weight(EMBED)) if whole else None  # the device-side lookup of pipelined greedy decode
            self.embed = None if embed is None else bind_embed_row(kernels, embed, self.token_ids[0].buffer,
                                                                   self.x.buffer, rows)
        if draft is not None:
            self.draft = self._bind_draft(*draft)
        if spill is not None:  # after every other weight: the routed experts get what is left of the budget
            self._place_split(mtp)
        # the first split layer: where a decoded token ticks the usage scores' clock
        self.first_split = next((layer.split.layer for layer in self.layers if layer.split is not None), None)
        self.owner: DecodePipeline | RowsPipeline | None = None  # the pipeline whose token is in flight
        self.sample_scratch: SampleScratch | None = None  # the buffers of SampledChoice (made on first use)
        self.watcher: RouteWatcher | None = None  # see watch_routes
        self.tokens = 0  # tokens enqueued: token n's routed ids go to slot n % ID_SLOTS
        self.slot_of = [0] * TURNS  # per turn: the id slot of the last token queued at that turn

    # ---- building ----------------------------------------------------------------------------------

    def _pack_vectors(self) -> DeviceArray:
        """Every 1-D weight of the main layers (norms, biases, router bias) in one buffer, at `self.offsets`."""
        names = [final_norm_spec(self.cfg).weight, *(name for spec in self.specs for name in spec.vectors())]
        if self.draft_spec is not None:
            spec, mtp = self.draft_spec
            names += [*spec.vectors(), mtp.enorm.weight, mtp.hnorm.weight, mtp.head_norm.weight]
        arrays = [np.asarray(self._weight(n), np.float32).reshape(-1) for n in names]
        self.offsets = dict(zip(names, np.cumsum([0] + [a.size for a in arrays[:-1]]).tolist(), strict=True))
        return self.buffers.filled(np.concatenate(arrays))

    def _matrix(self, name: str) -> ClWeight:
        cw = self._cw(self._weight(name))
        if cw is None:
            raise Unsupported(f"{name} cannot be used in place")
        return cw

    def _matvec(self, w: ClWeight, x: DeviceArray, y: DeviceArray, heads: int = 1, head_rows: int = 0,
                row_start: int = 0, rows: int | None = None, quantized: Int8Codes | None = None,
                codes_out: Int8Codes | None = None) -> tuple[Launch, ...]:
        """`y[h] = x[h] . W[h * head_rows + row_start ...]` for contiguous rows x[h] (`n_in` apart): int8 inputs
        where `x8_eligible` (x's codes from `quantized`, else a quantize launch first), else float inputs.
        codes_out: y's int8 codes too (`_x8_scratch`), for the product that reads y next: written by the product's
        own kernel where it can (`Kernels.writes_codes`), else by a quantize launch after it."""
        k, tokens = self.k, self.rows
        rows = w.rows if rows is None else rows
        if not self._x8(w.bits, w.group, w.n_in):
            launches: tuple[Launch, ...] = (
                bind_matvec(k, w, x.buffer, y.buffer, heads, w.n_in, head_rows, row_start, rows, tokens),)
        else:
            launches = ()
            if quantized is None:
                quantized = self._x8_scratch(tokens * heads * w.n_in)
                launches = (bind_quantize(k, x.buffer, w.n_in, tokens * heads, quantized),)
            if codes_out is not None and k.writes_codes and rows % X8_BLOCK == 0:
                return (*launches, bind_matvec_x8(k, w, quantized, y.buffer, heads, head_rows, row_start, rows,
                                                  codes_out, tokens))
            launches += (bind_matvec_x8(k, w, quantized, y.buffer, heads, head_rows, row_start, rows,
                                        tokens=tokens),)
        if codes_out is not None:
            launches += (bind_quantize(k, y.buffer, heads * rows, tokens, codes_out),)
        return launches

    def _pairs(self, w: ClWeight, w2: ClWeight) -> bool:
        """Whether two products of the normed hidden state u run as one launch (`bind_matvec_pair`)."""
        return (self.u_x8 is not None and self._x8(w.bits, w.group, w.n_in)
                and (w.suffix, w.n_in, w.group, w.row_bytes) == (w2.suffix, w2.n_in, w2.group, w2.row_bytes))

    def _matvec_pair(self, w: ClWeight, y: DeviceArray, w2: ClWeight, y2: DeviceArray) -> tuple[Launch, ...]:
        """`y = W u` and `y2 = W2 u`: one launch where `_pairs`, else two `_matvec`s."""
        if self._pairs(w, w2):
            return (bind_matvec_pair(self.k, w, w2, self.u_x8, y.buffer, y2.buffer, self.rows),)
        return (*self._matvec(w, self.u, y, quantized=self.u_x8), *self._matvec(w2, self.u, y2, quantized=self.u_x8))

    def _whole(self, a: DeviceArray) -> Addend:
        """`a` as an addend of one row of weight 1."""
        return Addend(a.buffer, self.one_range.buffer, self.one_weight.buffer)

    def _norm(self, x: DeviceArray, a: Addend | None, norm: NormSpec, y: DeviceArray, n: int,
              quantized: Int8Codes | None = None, x_off: int = 0, y_off: int = 0, rows: int | None = None) -> Launch:
        """`x += a` (unless None), then `y = RMSNorm(x)` (`norm`, bias-free) over each token row (`rows` of them from
        float x_off of x and y_off of y; default all); its int8 codes into `quantized` (`_x8_scratch`) when given."""
        add = a or self._whole(x)  # unused buffers when not adding, or not quantizing
        codes = quantized or Int8Codes.unused(y.buffer)
        return self.k.bind("residual_rms_norm", (self.red, rows or self.rows), (self.red, 1), x=x.buffer, x_off=x_off,
                           **add.args(), add=int(a is not None), w=self._vectors.buffer,
                           w_off=self.offsets[norm.weight], y=y.buffer, y_off=y_off, n=n, eps=norm.eps,
                           quantize=int(quantized is not None), **codes.args())

    def _rope(self, x: DeviceArray, x_off: int, x_row: int, y: DeviceArray, y_row: int, width: int, rows: int
              ) -> Launch:
        """RoPE on the first rope dims of `rows` rows per token row of x (from float x_off, x_row apart) into y
        (y_row apart), `width` values per row."""
        return self._reads_cs(self.k.bind("rope_rows", (width, rows * self.rows), None, x=x.buffer, x_off=x_off,
                                          x_row=x_row, y=y.buffer, y_off=0, y_row=y_row, cs=self.cs[0].buffer,
                                          width=width, n_half=self.model_specs[0].attention.rope // 2, per_cs=rows))

    def _reads_cs(self, launch: Launch) -> Launch:
        """Record that `launch` reads the cos/sin buffer (its argument `cs`, set per turn)."""
        self._cs_users.append(launch)
        return launch

    def _grow(self, keys: int) -> None:
        """Per-key scratch for at least `keys` keys, per token row: attention scores (then probabilities), indexer
        scores, the selection, and per turn the keys the selection may choose (all ones for one row:
        `_mask_causal`)."""
        if keys <= self.capacity:
            return
        cap = max(keys, 2 * self.capacity)
        nh, rows = self.cfg.num_attention_heads, self.rows
        new = self.buffers.array
        blocks = -(-cap // SHADOW_BLOCK)
        self.scratch = {"scores": new(rows * nh * cap), "index_scores": new(rows * cap),
                        "selected": new(rows * cap, np.uint8), "upper": new(rows * cap),
                        "listed": new(rows * cap, np.uint32), "listed_count": new(rows, np.uint32),
                        **{name: new(rows * blocks) for name in ("block_lower", "block_upper")}}
        # (a sequences step's rows are each their cache's last: no mask, one all-ones array)
        self.allowed = [self.buffers.filled(np.ones(rows * cap), np.uint8)
                        for _ in range(TURNS if rows > 1 and not self.sequences else 1)]
        self.masked = [[] for _ in range(TURNS)]
        self.capacity = cap
        scores, index_scores = self.scratch["scores"].buffer, self.scratch["index_scores"].buffer
        # the bound launches that read the scratch get the new buffers (a sequences step: each row's own too)
        for layer in [view for bound in self._bound_layers() for view in (bound, *bound.seqs)]:
            layer.attention.set(scores=scores)
            layer.values.set(scores=scores)
            if layer.scores is not None:
                layer.scores.set(out=index_scores)
                layer.topk.set(scores=index_scores, allowed=self.allowed[0].buffer,
                               selected=self.scratch["selected"].buffer)
            if layer.shadow_scores is not None:
                bounds = self._scratch_args("upper", "block_lower", "block_upper")
                layer.shadow_scores.set(**bounds)
                layer.candidates.set(**bounds, listed=self.scratch["listed"].buffer,
                                     count=self.scratch["listed_count"].buffer)
                layer.rescore.set(listed=self.scratch["listed"].buffer, count=self.scratch["listed_count"].buffer,
                                  out=index_scores)
                layer.select.set(scores=index_scores, listed=self.scratch["listed"].buffer,
                                 count=self.scratch["listed_count"].buffer)

    def _scratch_args(self, *names: str) -> dict[str, Any]:
        """Kernel arguments named after per-key scratch arrays: their buffers."""
        return {name: self.scratch[name].buffer for name in names}

    def _bind_shadow_selection(self, out: _Layer, ix: IndexerSpec, query: list[Launch]) -> None:
        """The shadow selection's launches of a layer with an indexer (DESIGN section "DSA indexer"): the new keys'
        shadows (appended to `out.head`), then over the query the stage-1 scores from the shadows, the keys that may
        be among the top-k, their exact scores and the top-k among them (`out.shadowed`); the cache arrays, key
        counts and the turn's causal mask are set per token."""
        k, cfg, scratch = self.k, self.cfg, self.scratch
        ihd, inh, kv = cfg.index_head_dim, cfg.index_n_heads, self.kv_dtype
        unset = self.key.buffer  # a placeholder until the token's arrays are set
        out.shadow = k.bind("index_shadow_rows", (self.rows,), None, kv_dtype=kv, index_k=unset, index_k_scale=unset,
                            shadow=unset, shadow_scale=unset, row=0, d=ihd)
        out.head.append(out.shadow)
        scores = {"q": self.iq_rot.buffer, "w": self.iw.buffer, "nh": inh, "d": ihd, "n_keys": 1,
                  "w_scale": ix.head_scale}
        bounds = self._scratch_args("upper", "block_lower", "block_upper")
        out.shadow_scores = k.bind("index_shadow_scores", (SHADOW_GROUP, self.rows), (SHADOW_GROUP, 1), **scores,
                                   shadow=unset, shadow_scale=unset, allowed=self.allowed[0].buffer, **bounds,
                                   scale=ix.score_scale, bound=shadow_bound(ihd, inh) * abs(ix.score_scale))
        out.candidates = k.bind("index_candidates", (self.rows,), None, **bounds, listed=scratch["listed"].buffer,
                                allowed=self.allowed[0].buffer, count=scratch["listed_count"].buffer, n_keys=1,
                                k=ix.topk, max_listed=1, n_rows=self.rows)
        out.rescore = k.bind("index_scores_listed", (KEY_GROUP, self.rows), (KEY_GROUP, 1), kv_dtype=kv,
                             **scores, k=unset, k_scale=unset, listed=scratch["listed"].buffer,
                             count=scratch["listed_count"].buffer, out=scratch["index_scores"].buffer,
                             scale=ix.score_scale)
        out.select = k.bind("topk_listed", (self.rows,), None, scores=scratch["index_scores"].buffer,
                            listed=scratch["listed"].buffer, count=scratch["listed_count"].buffer,
                            chosen=self.chosen.buffer, n_keys=1, k=ix.topk, n_rows=self.rows)
        out.shadowed = [*query, out.shadow_scores, out.candidates, out.rescore, out.select]

    def _bind_row_views(self, layer: _Layer) -> None:
        """A sequences step: per token row r, `layer` with its PER_ROW launches for row r alone (`layer.seqs[r]`, whose
        cache arrays, position and key count `_bind_cache` sets to that row's sequence's), and the launches of the
        indexer's query that run once for all rows (`layer.query`)."""
        per_row: dict[Launch, list[Launch]] = {}  # a PER_ROW launch -> its copy per row
        for r in range(self.rows):
            view = copy.copy(layer)
            view.cache_buffers, view.seqs = {}, []
            for name in PER_ROW:
                launch = getattr(layer, name)
                if launch is not None:
                    mine = launch.at_row(len(launch.size) - 1, r)
                    setattr(view, name, mine)
                    per_row.setdefault(launch, []).append(mine)
                    if launch in self._cs_users:
                        self._cs_users.append(mine)
            view.scoring = [view.scores, view.topk] if layer.scores is not None else []
            view.shadowed = ([view.shadow_scores, view.candidates, view.rescore, view.select]
                             if layer.shadow_scores is not None else [])
            layer.seqs.append(view)
        layer.query = [launch for launch in layer.scoring if launch not in per_row]

        def row_by_row(launches: list[Launch]) -> list[Launch]:
            """`launches` with each run of consecutive PER_ROW ones queued a row at a time: a row's attention scores
            (at its own key count's stride in the shared scratch) are consumed before the next row's are written."""
            out: list[Launch] = []
            run: list[Launch] = []
            for launch in [*launches, None]:
                if launch in per_row:
                    run.append(launch)
                    continue
                out += [per_row[each][r] for r in range(self.rows) for each in run]
                run = []
                if launch is not None:
                    out.append(launch)
            return out

        layer.rows_head, layer.rows_tail = row_by_row(layer.head), row_by_row(layer.tail)

    def _bound_layers(self) -> list[_Layer]:
        """The main layers' launches, then the MTP layer's (with a draft)."""
        return self.layers + ([self.draft.layer] if self.draft is not None else [])

    def _bind_draft(self, spec: LayerSpec, mtp: MTPSpec) -> _Draft:
        """The launches of MTP's draft after the verified rows (`_Draft`): the MTP layer `spec` on
        `eh_proj([enorm(emb(t)) ; hnorm(h)])` of each row's greedy token t and main hidden state h, as
        `GlmMoeDsaModel.mtp_forward` runs them, into `draft_logits` and the greedy `drafted`."""
        k, h, rows, new = self.k, self.cfg.hidden_size, self.rows, self.buffers.array
        vocab = self.logits.host.size // rows
        self.verified, self.drafted = new(rows, np.uint32), new(rows, np.uint32)
        emb, joined = new(rows * h), new(rows * 2 * h)
        self.draft_hidden, self.draft_logits = new(rows * h), new(rows * vocab)
        pieces = ((emb, mtp.enorm), (self.hidden, mtp.hnorm))  # [embedding ; hidden] per row
        head = [self._norm(x, None, norm, joined, h, x_off=r * h, y_off=(2 * r + part) * h, rows=1)
                for r in range(rows) for part, (x, norm) in enumerate(pieces)]
        head += self._matvec(self._matrix(mtp.eh_proj), joined, self.x)
        layer = self._bind_layer(spec)
        tail = [self._norm(self.x, self.ffn_out, mtp.head_norm, self.draft_hidden, h, self.hidden_x8),
                *self._matvec(self._matrix(LM_HEAD), self.draft_hidden, self.draft_logits, quantized=self.hidden_x8),
                k.bind("argmax_row", (self.red, rows), (self.red, 1), x=self.draft_logits.buffer, n=vocab,
                       token=self.drafted.buffer)]
        embed = self._matrix(EMBED)
        choose = k.bind("argmax_row", (self.red, rows), (self.red, 1), x=self.logits.buffer, n=vocab,
                        token=self.verified.buffer)
        return _Draft(choose, bind_embed_row(k, embed, self.verified.buffer, emb.buffer, rows), head, layer, tail)

    def _bind_layer(self, spec: LayerSpec) -> _Layer:
        """The launches of one decoder layer: its description's stages in `GlmMoeDsaModel.decoder_layer`'s order."""
        cfg, k, out, a = self.cfg, self.k, _Layer(), spec.attention
        h, nh, nope, rope, v_dim, kvl = cfg.hidden_size, a.heads, a.nope, a.rope, a.v_dim, a.kv_lora
        kv_b = self._matrix(a.kv_b)
        out.head = [
            # the first layer bound and the MTP layer start from x itself (an embedding, a pipeline stage's input
            # hidden state; eh_proj's output)
            self._norm(self.x, self.ffn_out if self.span.start < spec.index < cfg.num_hidden_layers else None,
                       spec.input_norm, self.u, h, self.u_x8),
            *self._matvec_pair(self._matrix(a.q_a), self.q_a, self._matrix(a.kv_a), self.comp),
        ]
        ix = a.indexer  # a layer with an indexer of its own (else it attends with the previous layer's choice)
        ihd, inh = cfg.index_head_dim, cfg.index_n_heads
        key_norm = {"kw_off": 0, "kb_off": 0}  # where the indexer key's LayerNorm weight and bias are
        if ix is not None:
            assert ix.key_norm.bias is not None
            wk, weights_proj = self._matrix(ix.wk), self._matrix(ix.weights_proj)
            # weights_proj's head weights matter only once the indexer scores; in the key's launch they cost ~nothing
            paired = self._pairs(wk, weights_proj)
            out.head += (self._matvec_pair(wk, self.key_raw, weights_proj, self.iw) if paired else
                         self._matvec(wk, self.u, self.key_raw, quantized=self.u_x8))
            key_norm = {"kw_off": self.offsets[ix.key_norm.weight], "kb_off": self.offsets[ix.key_norm.bias]}
        q_codes = self.q_lat_x8 or Int8Codes.unused(self.q_lat.buffer)  # q_b takes float inputs: not written
        # the cache rows (kv_lat, k_rot, index_k at `row`) and the staging buffer (stage) are set per token; at a
        # lower precision the rows go to `new_rows` and `kv_store_rows` stores them
        new_rows = {name: a.buffer for name, a in (self.new_rows or {}).items()}
        out.rows = self._reads_cs(k.bind(
            "token_rows", (self.red, self.rows), (self.red, 1), comp=self.comp.buffer, vec=self._vectors.buffer,
            w_off=self.offsets[a.kv_a_norm.weight], kv_lat=new_rows.get("kv_lat", self.comp.buffer),
            k_rot=new_rows.get("k_rot", self.comp.buffer), row=0,
            kvl=kvl, rope=rope, cs=self.cs[0].buffer, eps=a.kv_a_norm.eps, q_a=self.q_a.buffer,
            qw_off=self.offsets[a.q_a_norm.weight], q_lat=self.q_lat.buffer, qn=cfg.q_lora_rank,
            quantize=int(self.q_lat_x8 is not None), **q_codes.args(), index=int(ix is not None),
            key_raw=self.key_raw.buffer, **key_norm, tmp=self.key.buffer,
            index_k=new_rows.get("index_k", self.key.buffer), ihd=ihd, stage=self.row_stage[0].buffer,
            stage_off=NO_STAGE if k.direct else spec.index * self.rows * self.stage_width))
        out.head.append(out.rows)
        if new_rows:  # the cache rows and scales (and `row`) are set per token
            out.store = k.bind("kv_store_rows", (self.red, self.rows), (self.red, 1), kv_dtype=self.kv_dtype,
                               lat=new_rows["kv_lat"], rot=new_rows["k_rot"], idx=new_rows["index_k"],
                               **{f"{name}{part}": self.comp.buffer for name in new_rows for part in ("", "_scale")},
                               row=0, kvl=kvl, rope=rope, ihd=ihd, index=int(ix is not None))
            out.head.append(out.store)
        out.head += self._matvec(self._matrix(a.q_b), self.q_lat, self.q, quantized=self.q_lat_x8)
        if mvt_chunked(kv_b):  # the query's absorption and RoPE in one launch
            out.head.append(self._reads_cs(bind_mla_query(k, kv_b, self.q.buffer, nope + rope, self.q_abs.buffer,
                                                          nope, nope + v_dim, nh, self.cs[0].buffer,
                                                          self.q_rot.buffer, rope, self.rows)))
        else:
            out.head += [bind_matvec_t(k, kv_b, self.q.buffer, self.q_abs.buffer, nh, nope + rope, nope + v_dim, 0,
                                       nope, self.rows),
                         self._rope(self.q, nope, nope + rope, self.q_rot, rope, rope, nh)]
        scratch = self.scratch
        if ix is not None:  # the key row (`k`) and key count (`n_keys`) are set per token
            out.scores = k.bind("index_scores", (KEY_GROUP, self.rows), (KEY_GROUP, 1), kv_dtype=self.kv_dtype,
                                q=self.iq_rot.buffer, k=self.key.buffer, k_scale=self.key.buffer, w=self.iw.buffer,
                                out=scratch["index_scores"].buffer, nh=inh, d=ihd, n_keys=1, scale=ix.score_scale,
                                w_scale=ix.head_scale)
            name, size, local = k.topk_kernel(self.rows)
            out.topk = k.bind(name, size, local, scores=scratch["index_scores"].buffer,
                              allowed=self.allowed[0].buffer, selected=scratch["selected"].buffer,
                              chosen=self.chosen.buffer, n_keys=1, k=ix.topk, n_rows=self.rows)
            query = [*self._matvec(self._matrix(ix.wq_b), self.q_lat, self.iq, quantized=self.q_lat_x8),
                     self._rope(self.iq, 0, ihd, self.iq_rot, ihd, ihd, inh),
                     *(() if paired else self._matvec(weights_proj, self.u, self.iw, quantized=self.u_x8))]
            out.scoring = [*query, out.scores, out.topk]
            if self.shadow_selects:
                self._bind_shadow_selection(out, ix, query)
        # the cache rows (kv_lat, k_rot), the key counts (n, n_total) and whether the indexer chose the keys
        # (use_keys) are set per token
        out.attention = k.bind("mla_decode_scores", (KEY_GROUP, 1, self.rows), (KEY_GROUP, 1, 1),
                               kv_dtype=self.kv_dtype, q_lat=self.q_abs.buffer, q_rot=self.q_rot.buffer,
                               kv_lat=self.comp.buffer, kv_lat_scale=self.comp.buffer, k_rot=self.comp.buffer,
                               k_rot_scale=self.comp.buffer, keys=self.chosen.buffer, use_keys=0,
                               scores=scratch["scores"].buffer, nh=nh, n=1, n_total=1, kvl=kvl, rope=rope,
                               scale=a.scale)
        # the values kernel writes o_lat's codes too when kv_b's value product takes int8 inputs
        o_lat_x8 = self._x8_scratch(self.rows * nh * kvl) if self._x8(kv_b.bits, kv_b.group, kv_b.n_in) else None
        value_codes = o_lat_x8 or Int8Codes.unused(self.o_lat.buffer)
        out.values = k.bind("mla_decode_values", (nh * self.red, self.rows), (self.red, 1), kv_dtype=self.kv_dtype,
                            scores=scratch["scores"].buffer, kv_lat=self.comp.buffer, kv_lat_scale=self.comp.buffer,
                            out=self.o_lat.buffer, n=1, n_total=1, kvl=kvl,
                            quantize=int(o_lat_x8 is not None), **value_codes.args(), keys=self.chosen.buffer,
                            use_keys=0)
        o_proj = self._matrix(a.o_proj)
        heads_x8 = (self._x8_scratch(self.rows * nh * v_dim) if self._x8(o_proj.bits, o_proj.group, o_proj.n_in)
                    else None)
        out.tail = [out.attention, out.values,
                    *self._matvec(kv_b, self.o_lat, self.heads_out, nh, nope + v_dim, nope, v_dim, quantized=o_lat_x8,
                                  codes_out=heads_x8),
                    *self._matvec(o_proj, self.heads_out, self.attn_out, quantized=heads_x8),
                    self._norm(self.x, self._whole(self.attn_out), spec.post_attention_norm, self.u, h, self.u_x8)]
        out.tail += self._bind_ffn(spec.ffn, out)
        fields = ("kv_lat", "k_rot", "index_k") if ix is not None else ("kv_lat", "k_rot")
        out.cache_fields = fields + tuple(f"{name}.scale" for name in fields) \
            if self.kv_dtype in SCALED_KV_DTYPES else fields
        return out

    def _bind_ffn(self, ffn: MLPSpec | MoESpec, out: _Layer) -> list[Launch]:
        """The FFN of one layer, its output left in `self.ffn_out` for the next norm to add. MoE: router logits,
        routing on the device, then the fused launches per weight buffer the layer's experts lie in (a layer can
        span files of the mapping), summed into `self.ffn` where there are several (or a shared expert apart)."""
        k, new = self.k, self.buffers.array

        def scheme(ref) -> tuple:
            return ref.key[1:]  # bits, quant scheme, group, n_in, inter

        if isinstance(ffn, MLPSpec):
            launches, self.ffn_out = self._bind_single(self._ref(ffn), self.ffn, summed=False)
            return list(launches)
        if self.spill is not None:
            return self._bind_split_moe(ffn, out)
        if self.experts is not None:
            return self._bind_arena_moe(ffn, out)
        r = ffn.router
        experts = [self._ref(ffn.expert(e)) for e in range(r.n_experts)]
        if len({scheme(ref) for ref in experts}) != 1:
            raise Unsupported(f"{r.weight}: the routed experts use more than one scheme")
        shared = [] if ffn.shared is None else [self._ref(ffn.shared)]
        apart = bool(shared) and scheme(shared[0]) != scheme(experts[0])  # e.g. q2: int2 routed, int4 shared
        if apart:
            separate, shared = shared[0], []
        members = experts + shared
        buffers = list({id(ref.buf): ref.buf for ref in members}.values())
        if len(buffers) > MAX_EXPERT_BUFFERS:
            raise Unsupported(f"{r.weight}: the layer's experts lie in {len(buffers)} weight buffers")
        table = self.buffers.filled([ref.offs for ref in members], np.uint64)
        buffer_of = self.buffers.filled([next(b for b, buf in enumerate(buffers) if buf is ref.buf)
                                         for ref in members], np.uint32)
        regions, stride, groups = self._slot_groups(experts[0], buffers, self.rows * (r.top_k + len(shared)), apart)
        out.ids = self._route_ids(r.top_k)
        logits = new(self.rows * r.n_experts)
        out.route = k.bind("route_noaux_tc", (1,), None, logits=logits.buffer, vec=self._vectors.buffer,
                           bias_off=self.offsets[r.bias], table=table.buffer, buffer_of=buffer_of.buffer,
                           n_buffers=len(buffers), n_experts=r.n_experts, n_group=r.n_group,
                           topk_group=r.topk_group, top_k=r.top_k, norm=int(r.norm_topk_prob), scaling=r.scaling,
                           shared=len(shared), stride=stride, ids=out.ids[0].buffer,  # ids: set per token slot
                           n_tok=self.rows, **{name: a.buffer for name, a in regions.items()})
        launches = [bind_matvec(k, self._matrix(r.weight), self.u.buffer, logits.buffer, tokens=self.rows), out.route,
                    *groups]
        if apart:
            launches += self._bind_apart(separate)
        return launches

    def _route_ids(self, top_k: int) -> list[DeviceArray]:
        """The next MoE layer's routed ids (`[rows, top_k]`), per token slot (views of `route_ids`)."""
        start, count = sum(lay.route is not None for lay in self.layers) * self.id_stride, self.rows * top_k
        return [DeviceArray(a.host[start:start + count], self.buffers.sub_buffer(a.buffer, 4 * start, 4 * count))
                for a in self.route_ids]

    def _slot_regions(self, n_buffers: int, n_slots: int) -> tuple[dict[str, DeviceArray], int]:
        """The slot arrays routing fills for `n_slots` experts in each of `n_buffers` weight buffers (buffer b's
        slots from `stride * b`: sub-buffers start at base_align multiples; room for a slot range per token row in
        tok_start). Returns (regions by name, stride)."""
        stride = self.buffers.aligned_items(max(n_slots, self.rows + 1))
        return {name: self.buffers.array(n_buffers * stride * width, dtype)
                for name, (width, dtype) in SLOT_ARRAYS.items()}, stride

    def _slot_groups(self, ref, buffers: list, n_slots: int, apart: bool
                     ) -> tuple[dict[str, DeviceArray], int, list[Launch]]:
        """`_slot_regions` for experts with `ref`'s scheme in `buffers`, and the fused launches per buffer, summed
        into `self.ffn` where there are several (or a shared expert `apart` follows). Returns (regions, stride,
        launches); `self.ffn_out` is their output."""
        regions, stride = self._slot_regions(len(buffers), n_slots)
        launches: list[Launch] = []
        summed = len(buffers) > 1 or apart
        for b, buf in enumerate(buffers):
            sub = {name: self.buffers.sub_buffer(regions[name].buffer, b * stride * width * np.dtype(dtype).itemsize,
                                                 n_slots * width * np.dtype(dtype).itemsize)
                   for name, (width, dtype) in SLOT_ARRAYS.items()}
            slots = ExpertSlots(sub["offs"], sub["slot_tok"], sub["tok_start"], sub["slot_w"], n_slots, self.rows)
            y = self.ffn if b == 0 else self.ffn_part
            bound, self.ffn_out = self._bind_experts(ref, slots, y, buf, summed)
            launches += bound
            if b:
                launches.append(self._add(self.ffn, self.ffn_part))
        if summed:
            self.ffn_out = self._whole(self.ffn)
        return regions, stride, launches

    def _bind_apart(self, shared) -> list[Launch]:
        """A shared expert of another scheme than the routed ones: its own launches, added after the routed sum
        (the model's order)."""
        return [*self._bind_single(shared, self.ffn_part)[0], self._add(self.ffn, self.ffn_part)]

    def _bind_arena_moe(self, ffn: MoESpec, out: _Layer) -> list[Launch]:
        """`_bind_ffn` for routed experts in the expert cache's slots: the router, `route_arena` (the slots of the
        experts read already, from where the cache's place table says they lie) and those experts' launches, per
        arena chunk, close the layer's queue; the host then waits for the routing, hands the ids to the cache and fills
        the other slots once their experts are read (`_place_misses`), queueing their launches (`out.after_misses`),
        then the rest of the layer (`out.after_route`). Every slot runs once, in whichever launch set, and the slots
        are summed in their order: the sums of the one-kernel routing over the mapping."""
        arena, r, k = self.experts, ffn.router, self.k
        if not arena.uniform_layout(ffn.layer):
            raise Unsupported(f"{r.weight}: the layer's experts are laid out unalike")
        if r.top_k > MAX_TOPK or r.topk_group * (r.n_experts // r.n_group) < r.top_k:
            raise Unsupported(f"{r.weight}: a routing that may choose fewer than top_k experts")
        routed, rel = self._slot_ref(arena.slot_weights(ffn.layer, 0), 0)
        shared_slot = None if ffn.shared is None else arena.shared_slot(ffn.layer)
        separate = None
        if ffn.shared is not None:
            views = [self._weight(name) for name in ffn.shared.names]
            shared_ref, shared_rel = self._slot_ref(views, shared_slot) if shared_slot is not None else (None, None)
            if shared_ref is None or shared_ref.key[1:] != routed.key[1:]:
                separate, shared_slot = self._ref(ffn.shared), None
        members = r.top_k + (shared_slot is not None)
        rows, n_slots, n_chunks = self.rows, self.rows * members, len(self.chunks)
        stride = self.buffers.aligned_items(n_slots)
        offs = self.buffers.array(n_slots * 6, np.uint64)
        slot_w = self.buffers.array(n_slots)
        first, after = (self.buffers.array(n_chunks * stride, np.uint32) for _ in range(2))
        first.host[:], after.host[:] = UNUSED_SLOT, UNUSED_SLOT
        tok_start = self.buffers.filled(np.arange(rows + 1) * members, np.uint32)
        if shared_slot is not None:  # each row's shared expert, in the slot after its routed ones, never moves
            shared_offs, shared_chunk = self._place_offsets(shared_rel, [shared_slot * arena.slot_bytes])
            shared_slots = np.arange(rows) * members + r.top_k
            offs.host.reshape(-1, 6)[shared_slots] = shared_offs[0]
            slot_w.host[shared_slots] = 1.0
            first.host.reshape(n_chunks, stride)[shared_chunk[0], shared_slots] = np.arange(rows)
        scratch = self._expert_scratch(n_slots, routed.shape)
        held: list[Launch] = []
        for c, chunk in enumerate(self.chunks):  # a launch set per chunk and mask, over the same slots
            out.after_misses.append([])
            for mask, launches in ((first, held), (after, out.after_misses[c])):
                tokens = self.buffers.sub_buffer(mask.buffer, c * stride * 4, n_slots * 4)
                bound, addend = self._bind_experts(routed, ExpertSlots(offs.buffer, tokens, tok_start.buffer,
                                                                       slot_w.buffer, n_slots, rows),
                                                   self.ffn, chunk, False, scratch)
                launches += bound
        if separate is None:
            self.ffn_out = addend  # the next norm adds the slots' down rows
        else:  # the routed slots summed, then the shared expert's rows added (the model's order)
            shared, _ = self._bind_single(separate, self.ffn_part)
            held += shared
            out.after_route = [bind_expert_sum(k, addend.rows, ExpertSlots(offs.buffer, None, tok_start.buffer,
                                                                             slot_w.buffer, n_slots, rows),
                                               self.ffn.buffer, routed.shape.n_in),
                               self._add(self.ffn, self.ffn_part)]
            self.ffn_out = self._whole(self.ffn)
        out.ids = self._route_ids(r.top_k)
        logits = self.buffers.array(rows * r.n_experts)
        out.route = k.bind("route_arena", (1,), None, logits=logits.buffer, vec=self._vectors.buffer,
                           bias_off=self.offsets[r.bias], n_experts=r.n_experts, n_group=r.n_group,
                           topk_group=r.topk_group, top_k=r.top_k, norm=int(r.norm_topk_prob), scaling=r.scaling,
                           places=self.place_table, places_off=ffn.layer * r.n_experts,
                           rel=self.buffers.filled(rel, np.uint64).buffer,
                           chunk_bytes=self.chunk_slots * arena.slot_bytes,
                           n_chunks=n_chunks, members=members, stride=stride, offs=offs.buffer,
                           slot_w=slot_w.buffer, first=first.buffer, after=after.buffer,
                           ids=out.ids[0].buffer, n_tok=rows)  # ids: set per token slot
        out.arena = _ArenaLayer(ffn.layer, rows, r.top_k, members, rel, offs, first, after, stride)
        return [bind_matvec(k, self._matrix(r.weight), self.u.buffer, logits.buffer, tokens=rows), out.route, *held]

    def _bind_split_moe(self, ffn: MoESpec, out: _Layer) -> list[Launch]:
        """`_bind_ffn` for a discrete device that cannot hold every routed expert (`SpillDevice` beside it): the
        router and `route_noaux_tc` over one slot region (every expert's slot in one order, the shared one last,
        as over the whole model), closing the layer's queue; which experts run where is decided once every layer
        is bound (`_place_split`), the per-token part in `_run_split`."""
        r, k = ffn.router, self.k
        if r.top_k > MAX_TOPK or r.topk_group * (r.n_experts // r.n_group) < r.top_k:
            raise Unsupported(f"{r.weight}: a routing that may choose fewer than top_k experts")
        views = [tuple(self._weight(name) for name in ffn.expert(e).names) for e in range(r.n_experts)]
        cpu_rel = None
        if self.experts is not None:  # the CPU side reads the experts it runs from the expert cache's slots
            if not self.experts.uniform_layout(ffn.layer):
                raise Unsupported(f"{r.weight}: the layer's experts are laid out unalike")
            ref, cpu_rel = self._slot_ref(self.experts.slot_weights(ffn.layer, 0), 0, self.spill.expert_ref)
            cpu_refs = [ref] * r.n_experts
        else:
            cpu_refs = [self.spill.expert_ref(*triple) for triple in views]
        if any(ref is None for ref in cpu_refs) or len({ref.key[1:] for ref in cpu_refs}) != 1:
            raise Unsupported(f"{r.weight}: the routed experts cannot run as fused experts of one scheme on the CPU")
        shape = cpu_refs[0].shape
        shared = None if ffn.shared is None else self._ref(ffn.shared)
        separate = None
        if shared is not None and shared.key[1:] != cpu_refs[0].key[1:]:  # e.g. q4's int8 one in the MTP layer
            separate, shared = shared, None
        members = r.top_k + (shared is not None)
        regions, stride = self._slot_regions(1, self.rows * members)
        table = self.buffers.array((r.n_experts + 1) * 6, np.uint64)  # the resident experts' rows: `_place_split`
        if shared is not None:
            table.host[r.n_experts * 6:] = shared.offs
        scratch = self._expert_scratch(self.rows * members, shape)
        out.ids = self._route_ids(r.top_k)
        logits = self.buffers.array(self.rows * r.n_experts)
        out.route = k.bind("route_noaux_tc", (1,), None, logits=logits.buffer, vec=self._vectors.buffer,
                           bias_off=self.offsets[r.bias], table=table.buffer,
                           buffer_of=self.buffers.filled(np.zeros(r.n_experts + 1), np.uint32).buffer, n_buffers=1,
                           n_experts=r.n_experts, n_group=r.n_group, topk_group=r.topk_group, top_k=r.top_k,
                           norm=int(r.norm_topk_prob), scaling=r.scaling, shared=int(shared is not None),
                           stride=stride, ids=out.ids[0].buffer, n_tok=self.rows,  # ids: set per token slot
                           **{name: a.buffer for name, a in regions.items()})
        out.split = _SplitLayer(ffn.layer, views, cpu_refs, shape, r.top_k, members, self.rows, table, regions,
                                scratch, shared, cpu_rel)
        self.ffn_out = Addend(scratch[1], regions["tok_start"].buffer, regions["slot_w"].buffer)
        if separate is not None:  # the routed slots' sum, then the shared expert's rows added (the model's order)
            slots = ExpertSlots(None, None, regions["tok_start"].buffer, regions["slot_w"].buffer, self.rows * members,
                                self.rows)
            out.split.after = [bind_expert_sum(k, scratch[1], slots, self.ffn.buffer, shape.n_in),
                               *self._bind_apart(separate)]
            self.ffn_out = self._whole(self.ffn)
        return [bind_matvec(k, self._matrix(r.weight), self.u.buffer, logits.buffer, tokens=self.rows), out.route]

    def _place_split(self, mtp: tuple[LayerSpec, MTPSpec] | None) -> None:
        """Upload as many routed experts as the budget still holds once every other weight is on the device (with
        `mtp`, the MTP layer's and head's but their routed experts too: the verification's step binds them): the
        most used first (the spill device's `usage` scores, which earlier processes saved: a token then finds more
        of its experts on the device), and in ties, or with no scores, expert ranks in turn over the layers (each
        layer's expert 0, then each one's expert 1, ...: every layer keeps the same share); then bind each layer's
        launches on both sides (`_bind_split_sides`)."""
        split = [layer.split for layer in self._bound_layers() if layer.split is not None]
        if not split:
            return
        if mtp is not None:
            spec, head = mtp
            try:  # where they do not fit, the verification's step is built without its draft (the MTP head per op)
                for name in [*spec.matrices(), head.eh_proj]:
                    self._matrix(name)
                if isinstance(spec.ffn, MoESpec) and spec.ffn.shared is not None:
                    self._ref(spec.ffn.shared)
            except Unsupported:
                pass
        usage = self.spill.usage
        score = usage.score if usage is not None else lambda key: 0.0
        order = sorted(((e, i) for i, s in enumerate(split) for e in range(len(s.views))),
                       key=lambda p: (-score((split[p[1]].layer, p[0])), *p))
        for e, i in order:
            s = split[i]
            s.resident[e] = self._expert_ref(*s.views[e])
            if s.resident[e] is None:
                break  # the budget is spent
        if self.experts is not None:  # the CPU side's cache never reads what the device holds
            self.experts.hold_elsewhere((s.layer, e) for s in split for e, ref in enumerate(s.resident)
                                        if ref is not None)
        shape, spill = split[0].shape, self.spill.kernels.buffers
        x8 = self._x8(shape.bits, shape.group, shape.n_in, shape.inter)
        n = self.rows * self.cfg.hidden_size  # the CPU side's input: the post-attention norm's output u, or its codes
        if x8:
            arrays = (spill.array(2 * n, np.int8), spill.array(n // X8_BLOCK), spill.array(n // X8_BLOCK, np.int32))
            self.split_input = tuple(zip(self.u_x8, arrays, strict=True))
            x_cpu: Any = Int8Codes(*(a.buffer for a in arrays))
        else:
            self.split_input = ((self.u.buffer, spill.array(n)),)
            x_cpu = self.split_input[0][1].buffer
        for s in split:
            self._bind_split_sides(s, x_cpu, x8)

    def _bind_split_sides(self, s: _SplitLayer, x_cpu: Any, x8: bool) -> None:
        """A split layer's resident experts in the routing table and their fused launches per GPU buffer (each over
        every slot, masked to its own); the CPU side's launches per mapping window over its own slot arrays, its
        input `x_cpu` (u, or u's int8 codes where `x8`)."""
        buffers = list({id(ref.buf): ref.buf for ref in [*s.resident, s.shared] if ref is not None}.values())
        for e, ref in enumerate(s.resident):
            if ref is not None:
                s.table.host[e * 6:(e + 1) * 6] = ref.offs
                s.where[e] = next(b for b, buf in enumerate(buffers) if buf is ref.buf)
        self.buffers.to_device(s.table)
        regions, n_slots = s.regions, s.rows * s.members
        for buf in buffers:
            mask = self.buffers.filled(np.full(n_slots, UNUSED_SLOT), np.uint32)
            if s.shared is not None and s.shared.buf is buf:  # each row's shared expert, in this set every token
                mask.host.reshape(s.rows, s.members)[:, s.top_k], s.shared_set = np.arange(s.rows), len(s.masks)
                self.buffers.to_device(mask)
            slots = ExpertSlots(regions["offs"].buffer, mask.buffer, regions["tok_start"].buffer,
                                regions["slot_w"].buffer, n_slots, s.rows)
            s.masks.append(mask)
            s.sets.append(list(self._bind_experts(s.cpu_refs[0], slots, self.ffn, buf, False, (s.hid, s.part))[0]))
        spill, shape = self.spill.kernels, s.shape
        new = spill.buffers.array
        s.cpu_offs, s.cpu_part = new(n_slots * 6, np.uint64), new(n_slots * shape.n_in)
        tok_start = spill.buffers.filled(np.arange(s.rows + 1) * s.members, np.uint32)
        hid = new(n_slots * shape.inter)
        # a launch set per buffer the CPU side's experts lie in: the expert cache's arena chunks, else the mapping's
        cpu_buffers = (dict(enumerate(self.chunks)) if s.cpu_rel is not None else
                       {id(ref.buf): ref.buf for e, ref in enumerate(s.cpu_refs) if s.resident[e] is None})
        for key, buf in cpu_buffers.items():
            slot_tok = spill.buffers.filled(np.full(n_slots, UNUSED_SLOT), np.uint32)
            slots = ExpertSlots(s.cpu_offs.buffer, slot_tok.buffer, tok_start.buffer, tok_start.buffer, n_slots,
                                s.rows)
            part = s.cpu_part.buffer  # y: unused (the rows are not summed here)
            if x8:
                codes = self._x8_scratch(n_slots * shape.inter, spill.buffers)
                launches = bind_experts_x8(spill, buf, shape, x_cpu, slots, hid.buffer, codes, part, part, False)
            else:
                launches = bind_experts(spill, buf, shape, x_cpu, slots, hid.buffer, part, part, False)
            s.cpu_sets[key] = (slot_tok, list(launches))

    def _slot_ref(self, views: Sequence[Weight], slot: int, expert_ref: Callable | None = None
                  ) -> tuple[Any, np.ndarray]:
        """The fused-expert view of (gate, up, down) lying in arena slot `slot` (for its scheme and shape; by
        `expert_ref`, default this device's), and the byte offsets of its 6 arrays from the slot's start (uint64
        [6])."""
        ref, arrays = (expert_ref or self._expert_ref)(*views), fused_expert_arrays(*views)
        if ref is None or arrays is None:
            raise Unsupported(f"slot {slot} of the expert cache: cannot run as a fused expert in place")
        start = address(self.experts.arena) + slot * self.experts.slot_bytes
        return ref, np.array([address(a) - start for a in arrays], np.uint64)

    def _place_offsets(self, rel: np.ndarray, places: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(6 byte offsets per expert `[n, 6]` in its arena chunk, the chunk `[n]`) for experts laid out as `rel`
        starting at these byte offsets `places` of the arena."""
        at = np.asarray(places, np.uint64)
        chunk = np.uint64(self.chunk_slots * self.experts.slot_bytes)
        return (at % chunk)[:, None] + rel[None, :], (at // chunk).astype(np.uint32)

    def _place_misses(self, layer: _Layer, slot: int) -> list[int]:
        """Once the layer's routing has run (its ids, token slot `slot`, are final): hand the routed ids to the cache
        (its misses start reading) and name the next layer's likely experts to it; then for the slots `route_arena`
        left unplaced (their experts were not read when it ran) wait for the reads, write where the experts lie and
        mark each slot in its chunk's after launch set. Returns the arena chunks those experts lie in (whose after
        launch sets are to be queued). An expert several rows route to is read once and runs in a slot of each."""
        a = layer.arena
        routed = layer.ids[slot].host[:a.rows * a.top_k].reshape(a.rows, a.top_k).copy()
        slots = np.arange(a.rows)[:, None] * a.members + np.arange(a.top_k)  # [rows, k]
        unplaced = (a.first.host.reshape(-1, a.stride)[:, slots] == UNUSED_SLOT).all(axis=0)  # [rows, k]
        self.experts.on_route(a.layer, routed)
        self.experts.read_ahead(a.layer, self.u.host.reshape(self.rows, -1))
        if not unplaced.any():
            return []
        ids = routed[unplaced].tolist()
        unique = list(dict.fromkeys(ids))  # each expert once, however many rows route to it
        place_of = dict(zip(unique, self.experts.wait_places(a.layer, unique), strict=True))
        offs, chunks = self._place_offsets(a.rel, [place_of[e] for e in ids])
        a.offs.host.reshape(-1, 6)[slots[unplaced]] = offs
        a.after.host.reshape(-1, a.stride)[chunks, slots[unplaced]] = np.nonzero(unplaced)[0]
        return sorted(set(chunks.tolist()))

    def _add(self, y: DeviceArray, a: DeviceArray) -> Launch:
        n = self.rows * self.cfg.hidden_size
        return self.k.bind("add_into", (n,), None, y=y.buffer, a=a.buffer, n=n)

    def _ref(self, mlp: MLPSpec):
        ref = self._expert_ref(*(self._weight(name) for name in mlp.names))
        if ref is None:
            raise Unsupported(f"{mlp.gate}: cannot run as a fused expert in place")
        return ref

    def _bind_single(self, ref, y: DeviceArray, summed: bool = True) -> tuple[tuple[Launch, ...], Addend]:
        """One MLP (a dense layer's, or a shared expert) as fused launches over one slot of weight 1 per token row."""
        filled, rows = self.buffers.filled, self.rows
        slots = ExpertSlots(filled(np.tile(ref.offs, rows), np.uint64).buffer,
                            filled(np.arange(rows), np.uint32).buffer, filled(np.arange(rows + 1), np.uint32).buffer,
                            filled(np.ones(rows)).buffer, rows, rows)
        return self._bind_experts(ref, slots, y, ref.buf, summed)

    def _expert_scratch(self, count: int, shape) -> tuple[DeviceArray, Any]:
        """(hidden rows, down rows' buffer) of `count` expert slots."""
        return self.buffers.array(count * shape.inter), self.buffers.array(count * shape.n_in).buffer

    def _bind_experts(self, ref, slots: ExpertSlots, y: DeviceArray, wbuf, summed: bool,
                      scratch: tuple[DeviceArray, Any] | None = None) -> tuple[tuple[Launch, ...], Addend]:
        """The fused launches over `slots` of experts with `ref`'s scheme in weight buffer `wbuf`, and their output
        as an addend: gate+up (with int8 inputs: and the hidden rows' quantization), down per slot, then the slots'
        sum into y when `summed`, else the slots' down rows are the addend. scratch: `_expert_scratch`'s (default:
        new)."""
        shape = ref.shape
        hid, part = scratch or self._expert_scratch(slots.count, shape)
        if self._x8(shape.bits, shape.group, shape.n_in, shape.inter):  # x: u's codes, by the post-attention norm
            launches = bind_experts_x8(self.k, wbuf, shape, self.u_x8, slots, hid.buffer,
                                       self._x8_scratch(slots.count * shape.inter), part, y.buffer, summed)
        else:
            launches = bind_experts(self.k, wbuf, shape, self.u.buffer, slots, hid.buffer, part, y.buffer, summed)
        return launches, self._whole(y) if summed else Addend(part, slots.tok_start, slots.slot_w)

    def _int8_input_bits(self, int8_activations: bool) -> frozenset[int]:
        """The weight widths whose products take int8-quantized inputs: int4 and int3 always (their own rounding
        dwarfs the inputs'); int8 too where the routed experts are int4, int3 or int2 (q4, q3, q2: a small KL cost,
        docs/QUALITY.md).
        A q8 model's products keep float inputs: int8 inputs would double its KL divergence
        (tools/quality_int8_activations.py)."""
        if not int8_activations:
            return frozenset()
        moe = next((spec.ffn for spec in self.model_specs if isinstance(spec.ffn, MoESpec)), None)
        if moe is None:
            return frozenset({3, 4})
        expert = self._weight(moe.expert(0).gate)
        return frozenset({3, 4, 8}) if getattr(expert, "bits", 32) < 8 else frozenset({3, 4})

    def _x8(self, bits: int, group: int, *widths: int) -> bool:
        return bits in self.x8_bits and x8_eligible(bits, group, *widths)

    def _x8_scratch(self, n: int, buffers: Any = None) -> Int8Codes:
        """Buffers of n int8-quantized inputs: codes (two orders: 2n bytes), n / X8_BLOCK scales and code sums (on
        `buffers`' device, default this step's)."""
        new = (buffers or self.buffers).array
        return Int8Codes(new(2 * n, np.int8).buffer, new(n // X8_BLOCK).buffer, new(n // X8_BLOCK, np.int32).buffer)

    # ---- one token ---------------------------------------------------------------------------------

    def _cache_buffer(self, layer: _Layer, kv, name: str, pos: int):
        """The buffer the kernels find a cache array's rows in (`_Layer.cache_fields`), up to date for the token rows
        at pos.. (`kv.length` rows, those the kernels write included): on direct devices one over the host storage (a
        new one after the cache grew it), else the array's device mirror, given the rows before pos that the host
        wrote since it last had them (`LayerKV.edited_from`)."""
        field, _, part = name.partition(".")
        if name in SHADOW_FIELDS:  # direct devices only (`shadow_selects`)
            arr = kv.shadow()[SHADOW_FIELDS.index(name)]
        else:
            arr = kv.scales(field) if part else kv.storage(field)
        if not self.k.direct:
            return self.mirrors.copy(kv, name, arr, pos).buf
        have = layer.cache_buffers.get(name)
        if have is None or have.host is not arr:
            have = layer.cache_buffers[name] = DeviceArray(arr, self.buffers.wrap(arr))
        return have.buffer

    def _mask_causal(self, keys: int, turn: int) -> None:
        """The keys each token row's selection may choose (`allowed[turn]`, rows of `keys`): row r not the
        keys after its own position (`keys - rows + r`); the earlier forward's zeros set back to 1 first."""
        allowed = self.allowed[turn].host
        allowed[self.masked[turn]] = 1
        self.masked[turn] = [r * keys + t for r in range(self.rows - 1) for t in range(keys - self.rows + r + 1, keys)]
        allowed[self.masked[turn]] = 0
        self.buffers.to_device(self.allowed[turn])

    def complete(self, event, turn: int) -> None:
        """Wait for the token of this turn (`event`: `_enqueue`'s), then store its cache rows (`_collect`)."""
        event.wait()
        self._collect(turn)

    def _collect(self, turn: int) -> None:
        """Discrete devices: copy the rows the forward of this turn staged (read back with it) into its host cache."""
        staged, self.staged[turn] = self.staged[turn], []
        rows = self.row_stage[turn].host.reshape(-1, self.rows, self.stage_width)  # [layer, token row, fields]
        for part in staged:
            for i, layer in part.layers:
                kv = part.cache.layer(i)
                for r in range(min(part.count, kv.length - part.pos)):
                    start = 0
                    for name, width in self.stage_fields.items():
                        if name in layer.cache_fields:
                            kv.put_row(part.pos + r, name, rows[i, part.first_row + r, start:start + width])
                        start += width

    def __call__(self, token: int, cache: KVCache, embed: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
        """Append `token` (its embedding row `embed [H]`; a step of several token rows: the embeddings `[rows, H]`
        of that many tokens) at position `cache.length`; see the class docstring."""
        self.settle()
        self.complete(self._enqueue(cache, 0, embed), 0)
        rows = self.rows
        return (self.logits.host.reshape(rows, -1).copy(), self.hidden.host.reshape(rows, -1).copy(),
                self.routes(0))

    def prompt(self, cache: KVCache, token_ids: Sequence[int], logits: bool = True
               ) -> tuple[np.ndarray | None, np.ndarray, list] | None:
        """Append the tokens `token_ids [S]` (S a multiple of the step's rows) at `cache.length..`, `rows` of them per
        forward, the forwards queued back to back: the host writes each forward's token ids for the device's
        embedding lookup and waits only for the forward TURNS before it, whose buffers the next one takes. Only the
        last forward runs the lm_head (none without `logits`); the others' hidden states go to `kept`, read back
        once. Returns (the last token's logits `[1, V]` or None, hidden `[S, H]`, the routes of every forward in
        order), each forward's as `__call__` gives them for the same tokens; None where the device cannot look the
        embeddings up."""
        rows = self.rows
        if len(token_ids) % rows:
            raise ValueError(f"{len(token_ids)} prompt tokens on a step of {rows} rows")
        if self.embed is None or not len(token_ids):
            return None
        self.settle()
        n, h, start = len(token_ids), self.cfg.hidden_size, cache.length
        head = rows if logits else 0  # the rows the lm_head runs for (their hidden states: in `hidden`)
        if n > head and (self.kept is None or self.kept.host.size < (n - head) * h):
            self.kept = self.buffers.array((n - head) * h)
        queued: deque[tuple[Any, int]] = deque()  # (event, turn) of each forward in flight, oldest first
        routes: list = []

        def finish_oldest() -> None:
            event, turn = queued.popleft()
            self.complete(event, turn)
            routes.extend(self.routes(turn))

        try:
            for forward, i in enumerate(range(0, n, rows)):
                if len(queued) == TURNS:  # this forward takes the turn of the oldest one in flight
                    finish_oldest()
                turn = forward % TURNS
                queued.append((self._enqueue(cache, turn, None, tokens=token_ids[i:i + rows],
                                             kept_row=i if i < n - head else None), turn))
            while queued:
                finish_oldest()
            hidden = np.empty((n, h), np.float32)
            kept = self.kept.host[:(n - head) * h] if n > head else None
            if kept is not None and not self.k.direct:
                self.buffers.download(kept, self.kept.buffer).wait()
        except BaseException:
            self.k.finish()
            self.staged = [[] for _ in range(TURNS)]  # the rows staged by the forwards in flight are dropped with them
            cache.truncate(start)
            raise
        if kept is not None:
            hidden[:n - head] = kept.reshape(n - head, h)
        if not head:
            return None, hidden, routes
        hidden[-rows:] = self.hidden.host.reshape(rows, h)
        return self.logits.host.reshape(rows, -1)[-1:].copy(), hidden, routes

    def decode_rows(self, caches: Sequence[KVCache], embed: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
        """A sequences step's forward: token row r (embedding `embed[r]`, `[rows, H]`) appended to `caches[r]` at its
        own length (`rows` distinct caches). Returns (logits `[rows, V]`, hidden `[rows, H]` after the final norm,
        routes), each row's bit for bit the single-row step's for its sequence alone."""
        self._check_sequences(caches)
        self.settle()
        self.complete(self._enqueue_rows(caches, 0, embed, None), 0)
        rows = self.rows
        return (self.logits.host.reshape(rows, -1).copy(), self.hidden.host.reshape(rows, -1).copy(),
                self.routes(0))

    def pipeline_rows(self, caches: Sequence[KVCache], tokens: Sequence[int],
                      embed_of: Callable[[Sequence[int]], np.ndarray], on_routes: Callable[[list], None] | None = None,
                      draws: Sequence[TokenDraws | None] | None = None) -> RowsPipeline | None:
        """glm-serve's batch decoded with the next forward queued before the host sees its tokens (`RowsPipeline`):
        token row r appends `tokens[r]` to `caches[r]`, and each row's next token is its argmax, or drawn as
        `draws[r]` (a host sampler) would draw it. None where this step cannot: no embedding lookup on the device, a
        draw `SampledChoice.fits` refuses, or a layer that waits for the host (an expert cache's slots, the split
        step's CPU side), whose placements a forward queued ahead would hold past another step's use of the same
        experts. embed_of(tokens): their embedding rows `[rows, H]`."""
        self._check_sequences(caches)
        draws = list(draws) if draws is not None else [None] * self.rows
        if len(tokens) != self.rows or len(draws) != self.rows:
            raise ValueError(f"{len(tokens)} tokens and {len(draws)} samplers for a step of {self.rows} sequences")
        if self.embed is None or self.argmax is None or self.experts is not None or self.spill is not None:
            return None
        if any(d is not None and not SampledChoice.fits(self, d) for d in draws):
            return None
        return RowsPipeline(self, caches, tokens, embed_of, on_routes, draws)

    def _check_sequences(self, caches: Sequence[KVCache]) -> None:
        if not self.sequences or len(caches) != self.rows or len({id(c) for c in caches}) != self.rows:
            raise ValueError(f"{len(caches)} caches for a step of {self.rows} sequences (distinct)")
        for cache in caches:
            self._check_dtype(cache)

    def _enqueue_rows(self, caches: Sequence[KVCache], turn: int, embed: np.ndarray | None,
                      choose: Callable[[int], Any] | None) -> Any:
        """Queue a sequences step's forward at this turn; returns the event of its last launch. embed: the rows'
        embeddings `[rows, H]` written by the host (nothing of this step may be in flight), or None: those of the
        tokens the device chose at the other turn, looked up on the device. choose(turn): queues the launches that
        choose each row's token on the device (into `token_ids[turn]`) after the logits; the last one's event."""
        positions = [cache.length for cache in caches]
        self._settle_growth([cache.layer(i) for cache in caches for i in self.span], 1, max(positions) + 1)
        self._place_rows(positions, turn)
        if embed is not None:
            self.x.host[:] = embed.reshape(-1)
            self.buffers.to_device(self.x)
        else:
            self.embed.set(token=self.token_ids[1 - turn].buffer)
            self.embed.enqueue()
        slot = self._next_slot(turn)
        for cache in caches:
            for i in self.span:
                cache.layer(i).claim(1)
        try:
            for i, layer in zip(self.span, self.layers, strict=True):
                self._queue_sequences_layer(i, layer, [cache.layer(i) for cache in caches], positions, slot, turn)
            self.final_norm.enqueue()
            event = self.lm_head.enqueue()
            if choose is not None:
                event = choose(turn)
            if not self.k.direct:  # what the host reads of this forward, behind its kernels
                reads = (self.token_ids[turn],) if choose is not None else self.outputs
                for a in (self.row_stage[turn], self.route_ids[slot], *reads):
                    event = self.buffers.to_host(a)
                self.staged[turn] = [_Staged(cache, pos, r, 1, [(i, layer.seqs[r]) for i, layer in
                                                                zip(self.span, self.layers, strict=True)])
                                     for r, (cache, pos) in enumerate(zip(caches, positions, strict=True))]
        except BaseException:
            self.k.finish()
            self.staged[turn] = []
            for cache, pos in zip(caches, positions, strict=True):
                cache.truncate(pos)
            raise
        return event

    def run_span(self, cache: KVCache, x: np.ndarray, chosen: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray | None, list]:
        """A pipeline stage's part of a decoded token (a step bound to `span`, without logits): the layers on the hidden
        state `x [1, H]` entering them, appended at `cache.layer(span.start).length`; chosen: the DSA selection `[1, K]`
        of the layer before them (None at layer 0, or with every key attended). Returns (the hidden state after the
        last layer `[1, H]`, the selection a following 'previous' layer reuses `[1, K]` int32 or None, routes)."""
        assert self.logits is None and self.span
        self.settle()
        scored = cache.layer(self.span.start).length + 1 > self.topk
        if scored and chosen is not None:
            self.chosen.host[:] = chosen.reshape(-1)
            self.buffers.to_device(self.chosen)
        elif scored and self.specs[0].attention.indexer is None:
            raise ValueError(f"layer {self.span.start} reuses the previous layer's selection: none was given")
        self.complete(self._enqueue(cache, 0, x), 0)
        return (self.x.host.reshape(1, -1).copy(), self.chosen.host.astype(np.int32)[None] if scored else None,
                self.routes(0))

    def verify(self, cache: KVCache, embed: np.ndarray, choose: bool
               ) -> tuple[np.ndarray, np.ndarray, list, tuple[np.ndarray, np.ndarray] | None]:
        """The token rows of embeddings `embed [rows, H]` appended at `cache.length` (MTP's verification of a token
        and its draft), and with `choose` (a step bound with a draft) in the same queue MTP's next drafts: each
        row's greedy token, then the MTP layer on them (its rows appended at the same positions) and its greedy
        draft. Returns (logits `[rows, V]`, hidden `[rows, H]`, routes, (greedy tokens `[rows]`, drafts `[rows]`) or
        None without `choose`)."""
        self.settle()
        self.complete(self._enqueue(cache, 0, embed, draft=choose), 0)
        logits, hidden, routes = (self.logits.host.reshape(self.rows, -1).copy(),
                                  self.hidden.host.reshape(self.rows, -1).copy(), self.routes(0))
        if not choose:
            return logits, hidden, routes, None
        return logits, hidden, routes, (self.verified.host.astype(np.int64), self.drafted.host.astype(np.int64))

    def drafts(self) -> bool:
        """Whether the step was bound with MTP's draft (`verify` with choose, `redraft`)."""
        return self.draft is not None

    def redraft(self, cache: KVCache, tokens: Sequence[int], hidden: np.ndarray) -> np.ndarray:
        """MTP's drafts `[rows]` after verified rows of main hidden states `hidden [rows, H]` and the tokens the
        host chose for them, the MTP layer's rows appended from its `cache` length (the rows' first position)."""
        assert self.draft is not None
        self.settle()
        pos = cache.layer(self.cfg.num_hidden_layers).length
        self._place_rows(range(pos, pos + self.rows), 0)
        self.hidden.host[:] = hidden.reshape(-1)
        self.verified.host[:] = tokens
        slot = self._next_slot(0)
        if not self.k.direct:
            self.buffers.to_device(self.hidden)
            self.buffers.to_device(self.verified)
        event = self._queue_draft(cache, pos, slot, 0, choose=False)
        if not self.k.direct:  # the MTP layer's rows and the drafts, behind its kernels
            for a in (self.row_stage[0], self.route_ids[slot], self.drafted):
                event = self.buffers.to_host(a)
            self.staged[0] = [_Staged(cache, pos, 0, self.rows, self._draft_layer(True))]
        self.complete(event, 0)
        return self.drafted.host.astype(np.int64)

    def watch_routes(self, hook: Callable[[int, np.ndarray], None]) -> None:
        """From now on call `hook(layer, expert ids [k])` as each MoE layer's routing completes on the device,
        before its experts run (from the OpenCL runtime's callback thread: `RouteWatcher`). Direct devices only:
        a discrete device holds every weight in its own memory, nothing is left to read ahead."""
        if self.k.direct:
            self.watcher = RouteWatcher(self.k, hook)

    def routes(self, turn: int) -> list[tuple[int, np.ndarray]]:
        """`(layer, expert ids [rows, k])` of every main MoE layer, as the token rows of this turn routed them; []
        over an expert cache (it saw them as they happened)."""
        if self.experts is not None:
            return []
        slot = self.slot_of[turn]
        return [(i, layer.ids[slot].host.reshape(self.rows, -1).astype(np.int64))
                for i, layer in zip(self.span, self.layers, strict=True) if layer.route is not None]

    def settle(self) -> None:
        """Let the pipeline whose token is in flight (if any) finish it: the step's buffers are then free."""
        if self.owner is not None:
            self.owner.suspend()

    def _queue_layer(self, i: int, layer: _Layer, kv, pos: int, keys: int, slot: int, turn: int) -> Any:
        """Queue decoder layer i's launches (its cache rows `kv`) for the token rows at pos.. of `keys` keys in all;
        returns the event of its last launch."""
        selection = self._bind_cache(layer, kv, pos, keys, turn, self.rows)
        for launch in layer.head:
            launch.enqueue()
        for launch in selection:
            launch.enqueue()
        return self._queue_tail(i, layer, slot, layer.tail)

    def _queue_sequences_layer(self, i: int, layer: _Layer, kvs: Sequence, positions: Sequence[int], slot: int,
                               turn: int) -> Any:
        """A sequences step: queue decoder layer i for token row r appended to `kvs[r]` (its sequence's cache rows of
        this layer) at `positions[r]`: the shared launches once, each PER_ROW one per row bound to that row's cache;
        the indexer's query once where any row selects. Returns the event of its last launch."""
        selections = [self._bind_cache(view, kv, pos, pos + 1, turn, 1, r)
                      for r, (view, kv, pos) in enumerate(zip(layer.seqs, kvs, positions, strict=True))]
        for launch in layer.rows_head:
            launch.enqueue()
        if any(selections):
            for launch in layer.query:
                launch.enqueue()
        for selection in selections:
            for launch in selection:
                launch.enqueue()
        return self._queue_tail(i, layer, slot, layer.rows_tail)

    def _bind_cache(self, layer: _Layer, kv, pos: int, keys: int, turn: int, n_rows: int, base: int = 0
                    ) -> list[Launch]:
        """Set the launches of `layer` that read or write its cache rows `kv` for `n_rows` token rows at pos.. of
        `keys` keys in all (from token row `base` of the forward: a sequence's own launches, `_bind_row_views`).
        Returns the selection launches to queue after the head ([]: every key is attended)."""
        scored = keys > self.topk
        # per-key kernels: work-groups of KEY_GROUP items (a size left to the driver would follow the key count
        # down to groups of one item for a prime count: one work-group per key)
        per_key = -(-keys // KEY_GROUP) * KEY_GROUP
        attended = self.topk if scored else keys  # the keys attention reads: the indexer's choice, or all
        per_attended = -(-attended // KEY_GROUP) * KEY_GROUP
        heads = self.cfg.num_attention_heads if self.k.heads_apart else 1
        rows = {name: self._cache_buffer(layer, kv, name, pos) for name in layer.cache_fields}
        lat, rot = rows["kv_lat"], rows["k_rot"]
        scaled = {f"{name}_scale": rows.get(f"{name}.scale", rows[name]) for name in ("kv_lat", "k_rot")}
        row = (pos - base) % (1 << 32)  # the kernels write cache row `row` + their token row (uint arithmetic)
        if layer.store is None:
            layer.rows.set(kv_lat=lat, k_rot=rot, row=row)
        else:
            layer.store.set(row=row, **{name.replace(".", "_"): b for name, b in rows.items()})
        if layer.scores is not None:
            index_k = rows["index_k"]
            index_k_scale = rows.get("index_k.scale", index_k)
            if layer.store is None:
                layer.rows.set(index_k=index_k)
        if layer.shadow is not None:
            shadow, shadow_scale = (self._cache_buffer(layer, kv, name, pos) for name in SHADOW_FIELDS)
            layer.shadow.set(index_k=index_k, index_k_scale=index_k_scale, shadow=shadow, shadow_scale=shadow_scale,
                             row=row)
        if not self.k.direct:
            layer.rows.set(stage=self.row_stage[turn].buffer)
            kv.edited_from = kv.length  # the host gets this row with the others (`_collect`)
        allowed = self.allowed[turn % len(self.allowed)].buffer
        shadowed = keys >= max(SHADOW_MIN_KEYS, SHADOW_MIN_PER_KEPT * self.topk)
        selection: list[Launch] = []
        if scored and self.shadow_selects and layer.shadow is not None and shadowed:
            blocks = -(-keys // SHADOW_BLOCK)
            layer.shadow_scores.set(shadow=shadow, shadow_scale=shadow_scale, allowed=allowed, n_keys=keys)
            layer.shadow_scores.size = (-(-blocks // SHADOW_GROUP) * SHADOW_GROUP, n_rows)  # a block an item
            layer.candidates.set(allowed=allowed, n_keys=keys, max_listed=keys // LISTED_SHARE)
            layer.rescore.set(k=index_k, k_scale=index_k_scale, n_keys=keys)
            layer.rescore.size = (min(per_key, LISTED_ITEMS), n_rows)
            layer.select.set(n_keys=keys)
            selection = layer.shadowed
        elif scored and layer.scores is not None:
            layer.scores.set(k=index_k, k_scale=index_k_scale, n_keys=keys)
            layer.scores.size = (per_key, n_rows)
            layer.topk.set(n_keys=keys, allowed=allowed)
            selection = layer.scoring
        layer.attention.set(kv_lat=lat, k_rot=rot, **scaled, use_keys=int(scored), n=attended, n_total=keys)
        layer.attention.size = (per_attended, heads, n_rows)
        layer.values.set(kv_lat=lat, kv_lat_scale=scaled["kv_lat_scale"], n=attended, n_total=keys,
                         use_keys=int(scored))
        return selection

    def _queue_tail(self, i: int, layer: _Layer, slot: int, tail: list[Launch]) -> Any:
        """Queue decoder layer i's launches from attention on, `tail` (`layer.tail`, or a sequences step's
        `rows_tail`), with token slot `slot`'s routed ids; returns the event of its last launch."""
        if layer.route is not None:
            layer.route.set(ids=layer.ids[slot].buffer)
        routed = None
        for launch in tail:
            event = launch.enqueue()
            if launch is layer.route:
                routed = event
                if self.watcher is not None:
                    self.watcher.watch(event, i, layer.ids[slot].host)
        if layer.split is not None:
            event = self._run_split(layer, slot)
            for launch in layer.split.after:
                event = launch.enqueue()
        if layer.arena is not None:
            self.k.flush()  # the experts read already run while the host hears of the routing
            routed.wait()
            for chunk in self._place_misses(layer, slot):
                for launch in layer.after_misses[chunk]:
                    event = launch.enqueue()
            for launch in layer.after_route:
                event = launch.enqueue()
        return event

    def _run_split(self, layer: _Layer, slot: int) -> Any:
        """The routed experts of a split layer (`_SplitLayer`; its routing is queued): wait for the ids and the
        experts' input, queue the resident experts' launches, run the others on the CPU device meanwhile, and queue
        the upload of their rows into the device's per-slot rows. Returns the event of the last command."""
        s = layer.split
        self.buffers.to_host(layer.ids[slot])
        for buf, arr in self.split_input:
            event = self.buffers.download(arr.host, buf)
        event.wait()
        ids = layer.ids[slot].host[:s.rows * s.top_k].astype(np.int64).reshape(s.rows, s.top_k)  # [rows, k]
        usage = self.spill.usage
        if usage is not None:  # the decoded tokens' routes
            if s.layer == self.first_split:
                usage.tick(s.rows)
            for e in ids.ravel().tolist():
                usage.use((s.layer, e))
        where = s.where[ids]  # [rows, k]: each routed expert's launch set, -1 on the CPU side
        token = np.arange(s.rows)[:, None]  # [rows, 1]: a slot's token row
        for b, (mask, launches) in enumerate(zip(s.masks, s.sets, strict=True)):
            if (where == b).any() or b == s.shared_set:
                mask.host.reshape(s.rows, s.members)[:, :s.top_k] = np.where(where == b, token, UNUSED_SLOT)
                self.buffers.to_device(mask)
                for launch in launches:
                    event = launch.enqueue()
        self.k.flush()  # the device's experts run while the CPU device computes the others
        row, col = np.nonzero(where < 0)  # the CPU side's slots: row * members + col
        cpu_slots, cpu_ids = row * s.members + col, ids[row, col]
        cpu = cpu_slots.tolist()
        if s.cpu_rel is not None:  # the expert cache: the CPU side's misses start reading, then the next layer's
            self.experts.on_route(s.layer, cpu_ids[None, :])
            self.experts.read_ahead(s.layer, self._split_input_rows())
        if not cpu:
            return event
        spill, n = self.spill.kernels, s.shape.n_in
        offs = s.cpu_offs.host.reshape(-1, 6)
        if s.cpu_rel is not None:  # their places once read
            offs[cpu], chunk = self._place_offsets(s.cpu_rel, self.experts.wait_places(s.layer, cpu_ids.tolist()))
            where_cpu = chunk.tolist()
        else:
            offs[cpu] = [s.cpu_refs[e].offs for e in cpu_ids]
            where_cpu = [id(s.cpu_refs[e].buf) for e in cpu_ids]
        for key, (slot_tok, launches) in s.cpu_sets.items():
            mine = [i for i, at in enumerate(where_cpu) if at == key]
            if mine:
                slot_tok.host[:] = UNUSED_SLOT
                slot_tok.host[cpu_slots[mine]] = row[mine]
                for launch in launches:
                    launch.enqueue()
        spill.finish()
        rows = s.cpu_part.host.reshape(-1, n)
        for i in cpu:
            event = self.buffers.upload(s.part, rows[i], 4 * n * i)
        return event

    def _split_input_rows(self) -> np.ndarray:
        """The experts' input `[rows, H]` as the split step brought it to the host (read-ahead's estimate of the next
        layer's routing): u, or from u's int8 codes (each block's column-order half) times their block scales."""
        host = [array.host for _, array in self.split_input]
        if len(host) == 1:
            return host[0].reshape(self.rows, -1)
        codes = host[0].reshape(-1, 2, X8_BLOCK)[:, 1]  # a block's codes in the int4 products' order, then in columns
        return (codes.astype(np.float32) * host[1][:, None]).reshape(self.rows, -1)

    def _place_rows(self, positions: Sequence[int], turn: int) -> None:
        """Make ready for the forward of token rows at `positions` (consecutive ones of one cache, or a sequences
        step's rows' own): scratch for their keys, their cos/sin (`cs[turn]`, set on every launch that reads them),
        with several rows of one cache where the indexer selects the causal mask, and the KV copies' count of forwards
        (`KVMirrors.begin_forward`: the copies this one binds are its own)."""
        self.mirrors.begin_forward()
        keys = max(positions) + 1
        self._grow(keys)
        attention = self.model_specs[0].attention  # every layer's RoPE is the same (`check_bindable`)
        cos, sin = rope_cos_sin(np.asarray(positions), attention.rope, attention.rope_theta)
        self.cs[turn].host[:] = np.concatenate([cos, sin], axis=1).reshape(-1)
        self.buffers.to_device(self.cs[turn])  # the last token of this turn has finished: its copy was done
        cs = self.cs[turn].buffer
        for launch in self._cs_users:
            launch.set(cs=cs)
        if keys > self.topk and self.rows > 1 and not self.sequences:
            self._mask_causal(keys, turn)

    def _check_dtype(self, cache: KVCache) -> None:
        if cache.dtype != self.kv_dtype:
            raise ValueError(f"a cache of {cache.dtype} rows given to a decode step built for {self.kv_dtype}")

    def _next_slot(self, turn: int) -> int:
        """The routed-id slot of the forward queued next at this turn."""
        slot = self.slot_of[turn] = self.tokens % ID_SLOTS
        self.tokens += 1
        return slot

    def _draft_layer(self, draft: bool) -> list[tuple[int, _Layer]]:
        """[(the MTP layer's index, its bound launches)] where a forward ran MTP's draft, else []."""
        return [(self.cfg.num_hidden_layers, self.draft.layer)] if draft else []

    def _queue_draft(self, cache: KVCache, pos: int, slot: int, turn: int, choose: bool) -> Any:
        """Queue MTP's draft of the token rows at pos.. (`_Draft`; the MTP layer's rows are appended there): from
        the greedy tokens of the verification's logits (`choose`), else from the tokens the host wrote in
        `verified`. Returns the event of its last launch."""
        d, layer = self.draft, self.cfg.num_hidden_layers
        assert d is not None
        kv = cache.layer(layer)
        if kv.length != pos:
            raise ValueError(f"MTP's draft at position {pos}: the MTP layer holds {kv.length} rows")
        kv.claim(self.rows)
        if choose:
            d.choose.enqueue()
        d.lookup.enqueue()
        for launch in d.head:
            launch.enqueue()
        event = self._queue_layer(layer, d.layer, kv, pos, pos + self.rows, slot, turn)
        for launch in d.tail:
            event = launch.enqueue()
        return event

    def _enqueue(self, cache: KVCache, turn: int, embed: np.ndarray | None, choice: TokenChoice | None = None,
                 draft: bool = False, tokens: Sequence[int] | None = None, kept_row: int | None = None):
        """Queue one token's forward at position `cache.length`; returns the event of its last launch.

        embed: its embedding rows `[rows, H]`, written by the host (nothing may be in flight), or None: the
        embeddings of `tokens` (`[rows]`, the host writes them into `token_ids[turn]`: the forward queued last at this
        turn has finished), else of the token the device chose at the other turn, looked up on the device. choice:
        also choose the next token on the device (into `token_ids[turn]`). draft: MTP's draft of the rows follows
        (`_queue_draft`). kept_row: the hidden states go to the rows of `kept` from this one and no lm_head runs (a
        prompt's forward but its last)."""

        cfg, n_rows = self.cfg, self.rows
        if self.sequences:
            raise ValueError("a step of several sequences decodes through decode_rows")
        layers = [*self.span, *([cfg.num_hidden_layers] if draft else [])]
        self._check_dtype(cache)
        pos = cache.layer(self.span.start).length if self.span else cache.length
        keys = pos + n_rows
        self._settle_growth([cache.layer(i) for i in layers], n_rows, keys)
        self._place_rows(range(pos, keys), turn)
        if embed is not None:
            self.x.host[:] = embed.reshape(-1)
            self.buffers.to_device(self.x)
        slot = self._next_slot(turn)
        for i in self.span:
            cache.layer(i).claim(n_rows)
        if tokens is not None:
            self.token_ids[turn].host[:n_rows] = tokens
            self.buffers.to_device(self.token_ids[turn])
        if embed is None:
            self.embed.set(token=self.token_ids[turn if tokens is not None else 1 - turn].buffer)
            self.embed.enqueue()
        try:
            for i, layer in zip(self.span, self.layers, strict=True):
                event = self._queue_layer(i, layer, cache.layer(i), pos, keys, slot, turn)
            if kept_row is None:
                event = self.final_norm.enqueue()
                if self.lm_head is not None:
                    event = self.lm_head.enqueue()
            else:
                self.kept_norm.set(y=self.kept.buffer, y_off=kept_row * self.cfg.hidden_size)
                event = self.kept_norm.enqueue()
            if draft:
                event = self._queue_draft(cache, pos, slot, turn, choose=True)
            if choice is not None:
                event = choice.enqueue(turn)
            if not self.k.direct:  # what the host reads of this token, behind its kernels
                reads = ((self.token_ids[turn],) if choice is not None else
                         () if kept_row is not None else self.outputs)
                drafts = (self.verified, self.drafted) if draft else ()
                for a in (self.row_stage[turn], self.route_ids[slot], *reads, *drafts):
                    event = self.buffers.to_host(a)
                self.staged[turn] = [_Staged(cache, pos, 0, n_rows, [*zip(self.span, self.layers, strict=True),
                                                                      *self._draft_layer(draft)])]
        except BaseException:
            self.k.finish()
            cache.truncate(pos)
            raise
        return event

    def _settle_growth(self, kvs: Sequence[LayerKV], n_rows: int, keys: int) -> None:
        """Before a forward over `keys` keys claims `n_rows` more rows of each of `kvs`: where that reallocates the
        scratch or a cache array, every forward in flight (which uses the old arrays) finishes first and its staged
        rows are stored (a device copy of a grown array takes every row from the host again)."""
        if keys > self.capacity or any(kv.length + n_rows > len(kv.storage("kv_lat")) for kv in kvs):
            self.k.finish()
            for staged in range(TURNS):
                self._collect(staged)

    def pipeline(self, token: int, cache: KVCache, embed_of: Callable[[int], np.ndarray],
                 draws: TokenDraws | None = None, on_routes: Callable[[list], None] | None = None,
                 constraint: TokenMask | None = None) -> DecodePipeline | None:
        """Decoding from `token` with one forward in flight (`DecodePipeline`): greedy, or drawn as `draws` (a host
        sampler) would draw; with `constraint` (which has taken `token`), among the tokens it allows (`MaskedChoice`).
        None where the device cannot: no embedding lookup on the device, a sampled draw `SampledChoice.fits`
        refuses, or a constraint on a device whose memory the host does not write in place. embed_of(token): a
        token's embedding row `[H]`."""
        if self.embed is None or self.rows > 1 or (constraint is not None and not self.k.direct):
            return None
        if draws is not None and not SampledChoice.fits(self, draws):
            return None
        choice: TokenChoice = ArgmaxChoice(self) if draws is None else SampledChoice(self, draws)
        if constraint is not None:
            choice = MaskedChoice(self, choice, constraint)
        return DecodePipeline(self, cache, token, embed_of, on_routes, choice)

    def held_logits(self, parity: int, row: int = 0) -> np.ndarray:
        """The logits a draw kept for the host (`[V]`) of token row `row` of the forward of this parity (it has
        finished)."""
        held = self.sample_scratch.held[parity]
        event = self.buffers.to_host(held)
        if event is not None:
            event.wait()
        return held.host.reshape(self.rows, -1)[row]


class SampleScratch:
    """The buffers of `SampleLaunches` over `rows` token rows of `vocab` logits: all-ones and the selection
    (topk_select's), the candidates, each token's weight (sample_whole's and sample_nucleus's, float64: one row's, as
    the rows' draws run one after another), and per token parity the logits kept for the host."""

    def __init__(self, buffers, vocab: int, rows: int = 1) -> None:
        self.vocab, self.rows = vocab, rows
        self.all = buffers.filled(np.ones(rows * vocab), np.uint8)
        self.selected = buffers.array(rows * vocab, np.uint8)
        self.chosen = buffers.array(rows * SAMPLE_CANDIDATES, np.uint32)
        self.weight = buffers.array(vocab, np.float64)
        self.held = [buffers.array(rows * vocab), buffers.array(rows * vocab)]


class SampleLaunches:
    """The launches that draw a token from `vocab` logits on the device as a host `Sampler` with `params` would
    (sample.cl): with top-k, among its top_k + 1 largest logits (topk_select; the extra one tells a tie at the
    top-k boundary: sample_token); with top-p alone, over the whole vocabulary (sample_nucleus); with neither, the
    whole vocabulary drawn in index order (sample_whole). Token row `row` of the scratch's rows: its logits, its
    candidates, its token and flag (`token[row]`, `token[rows + row]`)."""

    def __init__(self, k: Kernels, logits: Any, params: SamplingSettings, scratch: SampleScratch,
                 row: int = 0) -> None:
        vocab = scratch.vocab
        top_k = params.top_k if 0 < params.top_k < vocab else 0  # as the host: top_k >= the vocabulary is no top-k
        if top_k + 1 > SAMPLE_CANDIDATES:
            raise ValueError(f"top_k {top_k}: more candidates than sample_token sorts ({SAMPLE_CANDIDATES})")
        self.select = None
        group = (k.red_lanes,)
        shared = {"logits": logits, "n": vocab, "temperature": params.temperature, "u": 0.0,
                  "token": scratch.chosen.buffer, "held": scratch.held[0].buffer,  # token, held, u: set per draw
                  "row": row, "rows": scratch.rows}
        if top_k:
            name, size, local = k.topk_kernel(scratch.rows)
            select = k.bind(name, size, local, scores=logits, allowed=scratch.all.buffer,
                            selected=scratch.selected.buffer, chosen=scratch.chosen.buffer, n_keys=vocab,
                            k=top_k + 1, n_rows=scratch.rows)
            self.select = select.at_row(len(size) - 1, row) if scratch.rows > 1 else select
            sorted_count = 1 << top_k.bit_length()  # the power of two >= top_k + 1 the bitonic sort runs over
            self.sample = k.bind("sample_token", group, group, **shared, cand=scratch.chosen.buffer,
                                 n_sorted=sorted_count, top_k=top_k, top_p=params.top_p)
        elif params.top_p < 1:
            self.sample = k.bind("sample_nucleus", group, group, **shared, top_p=params.top_p,
                                 weight=scratch.weight.buffer)
        else:
            self.sample = k.bind("sample_whole", group, group, **shared, weight=scratch.weight.buffer)

    def enqueue(self, u: float, token: Any, held: Any) -> Any:
        """Queue the draw for uniform u: token[0] the token, token[1] 1 where the host must choose (`held`, `[V]`,
        then holds the logits); returns the last launch's event."""
        if self.select is not None:
            self.select.enqueue()
        self.sample.set(u=u, token=token, held=held)
        return self.sample.enqueue()


class TokenChoice(Protocol):
    """How a pipelined forward chooses its token on the device (into `step.token_ids[parity]`)."""

    def enqueue(self, parity: int) -> Any:
        """Queue the launches that choose the token of the forward just queued at this parity; their last event."""
        ...

    def decided(self, parity: int) -> tuple[int, bool]:
        """(the token, whether the device chose it) of the earliest forward not yet decided (it has finished, at
        this parity); where the device could not, the host chooses it now."""
        ...

    def discard(self) -> None:
        """The last forward queued is dropped before its token is decided."""
        ...

    def unuse(self) -> None:
        """The token decided last is not used after all (the pipeline closes while holding it)."""
        ...

    def release(self) -> None:
        """The pipeline stops: no forward still queued will be decided."""
        ...


class ArgmaxChoice:
    """The greedy token: the argmax of the logits (argmax_row)."""

    def __init__(self, step: DeviceDecodeStep) -> None:
        self.step = step

    def enqueue(self, parity: int) -> Any:
        self.step.argmax.set(token=self.step.token_ids[parity].buffer)
        return self.step.argmax.enqueue()

    def decided(self, parity: int) -> tuple[int, bool]:
        return int(self.step.token_ids[parity].host[0]), True

    def discard(self) -> None:
        pass

    def unuse(self) -> None:
        pass

    def release(self) -> None:
        pass


class SampledChoice:
    """A token drawn from the logits with temperature, top-k and top-p on the device (sample.cl), from one uniform
    per forward that the host draws from the sampler's seeded stream as the forward is queued: the order of the
    draws is the host's (`SampleLaunches`). Where the device cannot decide (a tie at the top-k boundary, a decision
    within float64 rounding of a sum, sums that are not finite), the host draws the token from the logits with the
    same uniform (`TokenDraws.pick`). A uniform drawn for a forward that is dropped
    goes to the next one queued, and one never used goes back to the stream (`release`)."""

    def __init__(self, step: DeviceDecodeStep, draws: TokenDraws, row: int = 0) -> None:
        """`row`: the step's token row this choice draws (a sequences step's sequence), of its `rows`."""
        self.step, self.draws, self.row = step, draws, row
        if step.sample_scratch is None:
            step.sample_scratch = SampleScratch(step.buffers, step.logits.host.size // step.rows, step.rows)
        self.launches = SampleLaunches(step.k, step.logits.buffer, draws.params, step.sample_scratch, row)
        self.queued: deque[tuple[float, dict]] = deque()  # (uniform, the stream's state before it) per forward
        self.spare: list[tuple[float, dict]] = []  # uniforms of dropped forwards, for the next ones queued
        self.last: tuple[float, dict] | None = None  # the uniform of the token decided last

    @staticmethod
    def fits(step: DeviceDecodeStep, draws: TokenDraws) -> bool:
        """Whether the device can draw for these settings: float64 on the device, and a top-k whose candidates
        (top_k + 1) fit the sort."""
        top_k = draws.params.top_k
        return step.k.fp64 and draws.params.temperature > 0 and (
            top_k + 1 <= SAMPLE_CANDIDATES or top_k >= step.logits.host.size)

    def enqueue(self, parity: int) -> Any:
        if self.spare:
            drawn = self.spare.pop()
        else:
            state = self.draws.rng.bit_generator.state
            drawn = (self.draws.rng.random(), state)
        self.queued.append(drawn)
        return self.launches.enqueue(drawn[0], self.step.token_ids[parity].buffer,
                                     self.step.sample_scratch.held[parity].buffer)

    def decided(self, parity: int) -> tuple[int, bool]:
        self.last = self.queued.popleft()
        u = self.last[0]
        ids = self.step.token_ids[parity].host
        token, host = ids[self.row], ids[self.step.rows + self.row]
        if not host:
            return int(token), True
        return self.draws.pick(self.step.held_logits(parity, self.row), u), False

    def discard(self) -> None:
        self.spare.append(self.queued.pop())

    def unuse(self) -> None:
        self.spare.insert(0, self.last)

    def release(self) -> None:
        unused = self.spare or self.queued  # a dropped forward's uniform was drawn before any queued after it
        if unused:  # the stream goes back to before the first uniform no token used
            self.draws.rng.bit_generator.state = unused[0][1]
        self.spare.clear()
        self.queued.clear()


class MaskedChoice:
    """A constrained request's token on the device: `inner`'s choice (the argmax or a draw) over the logits with the
    tokens its `TokenMask` does not allow at -inf (mask_logits). The bitmask of a token's choice follows from the
    token before it, which the host learns only as the forward before finishes: that mask launch waits behind a user
    event, which the host completes once the constraint has taken that token and the bitmask is written
    (`decided`), a forward before the device reaches it. The host writes the bitmask in place (CPU devices)."""

    def __init__(self, step: DeviceDecodeStep, inner: TokenChoice, constraint: TokenMask) -> None:
        self.step, self.inner, self.constraint = step, inner, constraint
        vocab = step.logits.host.size
        self.bits = [step.buffers.array(-(-vocab // 32), np.int32) for _ in range(2)]  # per parity
        self.launch = step.k.bind("mask_logits", (vocab,), None, logits=step.logits.buffer,
                                  bitmask=self.bits[0].buffer, n=vocab)
        self.gates: deque[tuple[int, Any]] = deque()  # (parity, user event) of the choices queued before their bitmask
        self.current = True  # the constraint has taken every token before the next choice queued

    def enqueue(self, parity: int) -> Any:
        self.launch.set(bitmask=self.bits[parity].buffer)
        if self.current:
            self._write(parity)
            self.current = False
            self.launch.enqueue()
        else:
            gate = self.step.k.user_event()
            self.gates.append((parity, gate))
            self.launch.enqueue(wait_for=[gate])
        return self.inner.enqueue(parity)

    def _write(self, parity: int, anything: bool = False) -> None:
        """The bitmask of the constraint's next token at this parity (`anything`: every token, for a choice whose
        token is dropped unused)."""
        words = self.bits[parity].host
        words[:] = -1 if anything else self.constraint.allowed_bits()[:len(words)]

    def decided(self, parity: int) -> tuple[int, bool]:
        token, on_device = self.inner.decided(parity)
        try:
            self.constraint.accept(token)
            if self.gates:  # the choice queued after this token's forward: its bitmask is known now
                gate_parity, gate = self.gates.popleft()
                self._write(gate_parity)
                self.step.k.complete(gate)
            else:
                self.current = True
        except BaseException:
            self._open_gates()  # nothing queued may wait for the host any more
            raise
        return token, on_device

    def _open_gates(self) -> None:
        while self.gates:
            gate_parity, gate = self.gates.popleft()
            self._write(gate_parity, anything=True)
            self.step.k.complete(gate)

    def discard(self) -> None:
        self._open_gates()
        self.current = True  # the next choice queued follows the last token decided
        self.inner.discard()

    def unuse(self) -> None:
        self.constraint.rollback(1)
        self.current = True
        self.inner.unuse()

    def release(self) -> None:
        self._open_gates()
        self.inner.release()


def gives_way(fallbacks: int, decided: int) -> bool:
    """Whether a sampled pipeline stops for the host path: the host chose more than once, in over 1 in
    FALLBACK_SHARE of the `decided` tokens (or forwards)."""
    return fallbacks > 1 and fallbacks * FALLBACK_SHARE > decided


class DecodePipeline:
    """Decoding on the device step with the next forward queued before the host sees a token.

    The forward of a token ends with the choice of the next one on the device (`TokenChoice`: the argmax, or a
    sampled draw), and the forward of that token (its embedding looked up on the device) is queued while the host
    still handles the token before it: the device does not sit idle between tokens. `advance()` returns the next
    token; the cache then already holds the row of the token it returns. `close()` waits for the forward in flight
    and drops that row, leaving the cache as a one-token-at-a-time loop would.

    Where the host chose a token instead of the device (a sampled draw sample_token could not decide), the
    forward queued after it looked up the device's placeholder: it is dropped and the token's own forward queued.
    A sampled pipeline whose tokens were the host's choice more than once and in over 1 in FALLBACK_SHARE stops
    (`stopped`: nothing in flight, the sampler's stream as if the host had drawn every token so far): the caller
    goes on one token at a time.

    A pipeline owns the step while its forward is in flight; anything else that uses the step first lets it
    finish (`suspend`): the pipeline then keeps its next token and queues the following forward from the host.
    """

    def __init__(self, step: DeviceDecodeStep, cache: KVCache, token: int, embed_of: Callable[[int], np.ndarray],
                 on_routes: Callable[[list], None] | None, choice: TokenChoice) -> None:
        self.step, self.cache, self.embed_of, self.on_routes = step, cache, embed_of, on_routes
        self.choice = choice
        self.known: int | None = None  # the next token, when the forward that chose it has already finished
        self.pending: tuple[object, int] | None = None  # (event, parity) of the forward in flight
        self.decided = self.fallbacks = 0  # tokens decided, and those of them the host chose
        self.stopped = False
        self._start(token)

    @property
    def ahead(self) -> int:
        """Cache rows past the last token returned: 1 (that token's own row) until `close`."""
        return int(self.pending is not None or self.known is not None)

    def _start(self, token: int) -> None:
        """Queue `token`'s forward from its host embedding (nothing of this step may be in flight)."""
        self.step.settle()
        self.pending = (self.step._enqueue(self.cache, 0, self.embed_of(token), self.choice), 0)
        self.step.owner = self

    def advance(self) -> int:
        """The token after the last one returned (or the first one); its own forward is then in flight (none once
        `stopped`)."""
        if self.pending is None:
            if self.known is None:
                raise RuntimeError("the pipeline is closed")
            token, self.known = self.known, None
            self._start(token)
            return token
        event, parity = self.pending
        following = self.step._enqueue(self.cache, 1 - parity, None, self.choice)
        token, on_device = self._finish(event, parity)
        self.pending = (following, 1 - parity)
        if not on_device:  # `following` took the device's placeholder: drop it
            self._drop()
            if gives_way(self.fallbacks, self.decided):
                self.stopped = True
                self.choice.release()
            else:
                self._start(token)
        return token

    def _finish(self, event, parity: int) -> tuple[int, bool]:
        self.step.complete(event, parity)
        if self.on_routes is not None:
            self.on_routes(self.step.routes(parity))
        token, on_device = self.choice.decided(parity)
        self.decided += 1
        self.fallbacks += not on_device
        return token, on_device

    def _drop(self) -> None:
        """Finish the forward in flight and drop its cache row and its choice (nothing used its result: its routes
        are not reported)."""
        self.step.complete(*self.pending)
        self.pending = None
        self.choice.discard()
        if self.step.owner is self:
            self.step.owner = None
        self.cache.truncate(self.cache.length - 1)

    def suspend(self) -> None:
        """Finish the forward in flight and keep its token (another user of the step comes first)."""
        if self.pending is not None:
            self.known = self._finish(*self.pending)[0]
            self.pending = None
        if self.step.owner is self:
            self.step.owner = None

    def close(self) -> None:
        """Stop: finish the forward in flight and drop its cache row."""
        if self.pending is not None:
            self._drop()
        elif self.known is not None:
            self.choice.unuse()
            self.cache.truncate(self.cache.length - 1)
        self.known = None
        self.choice.release()


class RowsPipeline:
    """glm-serve's batch (a sequences step's rows, one sequence each) decoded with the next forward queued before the
    host sees the tokens, as `DecodePipeline` does for one sequence: each forward ends with every row's token chosen
    on the device (the argmax over the rows, then each sampled row's draw: `SampledChoice` at that row), and the
    following forward (those tokens' embeddings looked up on the device) is queued while the host still handles
    them. `advance()` returns each row's next token; every cache then already holds the row of the token it
    returns. Where the host chose a row's token (a draw the device could not decide), the forward queued after it
    looked up the device's placeholder: it is dropped and the next one queued from the host's tokens; where that
    happens in over 1 in FALLBACK_SHARE forwards (and more than once) the pipeline stops (`running` false, each
    sampler's stream as if the host had drawn every token). `close()` waits for the forward in flight and drops
    those rows, leaving the caches as `decode_rows` would: each without its last token's row. Another user of the
    step first (`settle`) closes it."""

    def __init__(self, step: DeviceDecodeStep, caches: Sequence[KVCache], tokens: Sequence[int],
                 embed_of: Callable[[Sequence[int]], np.ndarray], on_routes: Callable[[list], None] | None,
                 draws: Sequence[TokenDraws | None]) -> None:
        self.step, self.caches, self.embed_of, self.on_routes = step, list(caches), embed_of, on_routes
        self.draws = [None if d is None else SampledChoice(step, d, r) for r, d in enumerate(draws)]  # per row
        self.greedy = any(choice is None for choice in self.draws)  # a row the argmax chooses
        self.decided = self.fallbacks = 0  # forwards decided, and those with a token the host chose
        self.pending: tuple[object, int] | None = None
        self._start(tokens)

    @property
    def running(self) -> bool:
        """A forward is in flight: `advance` may be called."""
        return self.pending is not None

    def _start(self, tokens: Sequence[int]) -> None:
        """Queue the forward of `tokens` from their host embeddings (nothing of this step may be in flight)."""
        self.step.settle()
        self.pending = (self.step._enqueue_rows(self.caches, 0, self.embed_of(tokens), self._choose), 0)
        self.step.owner = self

    def _choose(self, turn: int) -> Any:
        """Queue each row's choice of its next token at this turn: the argmax of every row (where a row is greedy),
        then the draws."""
        event = None
        if self.greedy:
            self.step.argmax.set(token=self.step.token_ids[turn].buffer)
            event = self.step.argmax.enqueue()
        for choice in self.draws:
            if choice is not None:
                event = choice.enqueue(turn)
        return event

    def advance(self) -> list[int]:
        """Each row's token after the last ones returned (or the first ones); their forward is then in flight (none
        once the pipeline stopped)."""
        if self.pending is None:
            raise RuntimeError("the batch's pipeline is closed")
        event, turn = self.pending
        try:
            following = self.step._enqueue_rows(self.caches, 1 - turn, None, self._choose)
        except BaseException:
            self.close()
            raise
        self.step.complete(event, turn)
        if self.on_routes is not None:
            self.on_routes(self.step.routes(turn))
        ids = self.step.token_ids[turn].host
        chosen = [(int(ids[r]), True) if choice is None else choice.decided(turn)
                  for r, choice in enumerate(self.draws)]
        self.pending = (following, 1 - turn)
        tokens = [token for token, _ in chosen]
        self.decided += 1
        if not all(on_device for _, on_device in chosen):  # `following` looked up a placeholder: dropped
            self.fallbacks += 1
            self._drop()
            if gives_way(self.fallbacks, self.decided):
                self._release()
            else:
                self._start(tokens)
        return tokens

    def _drop(self) -> None:
        """Finish the forward in flight and drop its rows and its draws' uniforms (none of its tokens was used)."""
        self.step.complete(*self.pending)
        self.pending = None
        if self.step.owner is self:
            self.step.owner = None
        for choice in self.draws:
            if choice is not None:
                choice.discard()
        for cache in self.caches:
            cache.truncate(cache.length - 1)

    def _release(self) -> None:
        """Stop: every uniform drawn and not used goes back to its sampler's stream."""
        for choice in self.draws:
            if choice is not None:
                choice.release()
        if self.step.owner is self:
            self.step.owner = None

    def suspend(self) -> None:
        """Another user of the step comes first: stop here (`close`)."""
        self.close()

    def close(self) -> None:
        """Finish the forward in flight and drop its rows (none of its tokens was returned)."""
        if self.pending is not None:
            self._drop()
        self._release()
