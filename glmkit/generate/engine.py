"""`Engine`: an opened snapshot ready to generate (container, expert streaming, model, tokenizer)."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from glmkit.backends.numpy_backend import NumpyBackend
from glmkit.errors import GlmkitError
from glmkit.format.config import ModelConfig
from glmkit.format.reader import Container
from glmkit.generate.tokenizer import ChatTokenizer, read_side_json
from glmkit.model.compute import Backend
from glmkit.model.expert_cache import (
    CacheStats,
    ExpertCache,
    ExpertScores,
    activation_allowance,
    auto_cache_bytes,
    context_beside_cache,
    expert_slot_bytes,
    lendable_bytes,
    room_for_cache,
    routed_expert_bytes,
    save_scores,
    saved_scores,
    usage_path,
)
from glmkit.model.expert_stream import ExpertStats, ExpertStreamer, memory_limit_bytes, outgrows_memory
from glmkit.model.glm5 import GlmMoeDsaModel, span_rows_within
from glmkit.model.kv_cache import kv_bytes_per_token
from glmkit.units import format_size


def make_backend(device: str, container: Container | None = None, int8_activations: bool = True,
                 expert_usage: ExpertScores | None = None) -> tuple[Backend, str]:
    """`numpy`, `opencl[:P:D]` or `auto` (glmkit.backends.devices). Returns (backend, its name). expert_usage: see
    `open_backend`."""
    if device in ("numpy", "cpu"):
        return NumpyBackend(), "numpy"
    from glmkit.backends.devices import open_backend  # imports pyopencl: only when OpenCL may be used

    return open_backend(device, container, int8_activations, expert_usage)


class Engine:
    """device: `numpy` (the library default: scripts and benchmarks get the reference unless they ask),
    `auto` (the CLIs' default: measured placement) or `opencl[:P:D]` (see glmkit.backends.devices).
    float_activations: the device decode step's quantized products take float inputs (the reference arithmetic)
    instead of int8-quantized ones (faster: docs/BENCHMARKS.md).
    expert_cache: routed experts in a cache of this many bytes (`ExpertCache`), or "auto" (sized from the RAM the
    process may use: `auto_cache_bytes`), instead of the page cache (the device decode step reads them from its
    slots); 0: the page cache; None (default): "auto" where the container outgrows that RAM (`outgrows_memory`),
    unless ram_budget_bytes pins experts or the device is a discrete GPU holding the whole model, else 0. Beside a
    discrete GPU smaller than the model with a CPU OpenCL device (the split step) the cache holds only the routed
    experts the GPU leaves to the CPU device (`step_cache`; the model reads every other weight from the mapping).
    expert_usage_dir: where the routed experts' usage scores are kept from process to process (per model hash; None:
    neither read nor saved): the expert cache loads its hot set by them, a discrete GPU smaller than the model uploads
    the most used routed experts (the split step), and both add their tokens' routes. kv_dtype: the KV rows'
    precision (`glmkit.model.kv_cache.KV_DTYPES`). max_context: the most positions a sequence may hold (default: the
    model's `max_position_embeddings`, or fewer where a cache sized from the RAM could not keep room for that many
    beside two layers' experts: the positions it can; `config` says it from then on); a cache sized from the RAM
    keeps room for the KV rows of that many positions, which `kv_budget_tokens` then bounds (several sequences share
    it).
    announce: called with `expert_cache_reason` (where the routed experts will live, and why) once it is known,
    before the expert cache takes its memory: the CLIs print it, so a long start is not a silent one."""

    def __init__(self, snapshot: str | Path, device: str = "numpy", ram_budget_bytes: int = 0,
                 prefetch: bool = True, load_tokenizer: bool = True, float_activations: bool = False,
                 expert_cache: int | str | None = None, expert_usage_dir: Path | None = None,
                 kv_dtype: str = "f32", max_context: int | None = None,
                 announce: Callable[[str], None] | None = None):
        self.container = Container(snapshot)
        self.config = context_config(self.container.config, max_context)
        # what may still fail cheaply comes before anything that starts threads (the expert cache's reads)
        self.tokenizer = ChatTokenizer(snapshot, self.config.vocab_size) if load_tokenizer else None
        self.eos_token_ids = _eos_ids(Path(snapshot), self.config.eos_token_ids)
        self.usage_file = None if expert_usage_dir is None else usage_path(expert_usage_dir, self.container.model_hash)
        # the routed experts' usage as saved by earlier processes (read once): a discrete device smaller than the
        # model uploads the most used (the split step), an expert cache loads them first; both add their routes
        self.expert_usage = saved_scores(self.usage_file, self.container)
        self.step_cache: ExpertCache | None = None  # the split step's CPU side's expert cache
        # where the memory is budgeted (an expert cache beside the RAM's rest): the KV rows all sequences may hold
        self.kv_budget_tokens: int | None = None
        try:
            self._open(device, ram_budget_bytes, prefetch, float_activations, expert_cache, kv_dtype,
                       max_context is None, announce)
        except BaseException:
            Engine.close(self)  # an expert cache opened so far (its reads, its preloading); not a subclass's
            raise

    def _open(self, device: str, ram_budget_bytes: int, prefetch: bool, float_activations: bool,
              expert_cache: int | str | None, kv_dtype: str, fit_context: bool,
              announce: Callable[[str], None] | None) -> None:
        """The backend, the weight source (expert cache or page cache) and the model (see the class); a cache sized
        from the RAM leaves room for the KV rows of the context (`fit_context`: the model's, shortened to what fits).
        `announce(expert_cache_reason)` as soon as it is known: before the cache takes its slots' pages and copies
        the other weights (a minute or more at GLM-5's size)."""
        self.backend, self.device = make_backend(device, self.container, not float_activations, self.expert_usage)
        self.backend.release_memory()  # a device profile measured just now leaves freed memory the cache is sized after
        discrete = getattr(getattr(self.backend, "k", None), "direct", True) is False
        # a discrete GPU smaller than the model with a CPU device beside it (the split step): the experts it leaves
        # to the CPU side may come from an expert cache, which then holds no other weight (the GPU has them)
        split = discrete and self.backend.spill is not None and self.backend.over_budget
        self.experts: ExpertStreamer | ExpertCache  # the model's weight source
        self.expert_cache_reason = ""  # how an "auto" cache was sized
        fitted = ""
        if fit_context and not discrete and not ram_budget_bytes and expert_cache in (None, "auto"):
            self.config, fitted = fitted_context(self.container, self.config, kv_dtype, expert_cache == "auto")
        kv_bytes = kv_bytes_per_token(self.config, kv_dtype) * self.config.max_position_embeddings
        if expert_cache is None:
            expert_cache, why = ((0, "") if ram_budget_bytes or (discrete and not split) else
                                 default_expert_cache(self.container, pinned=not split, kv_bytes=kv_bytes,
                                                      lend_kv=not split))
            # said where the container outgrows the RAM: the cache's size, or why it fell back to the page cache
            self.expert_cache_reason = why if expert_cache or (why and outgrows_memory(self.container)) else ""
        elif expert_cache == "auto":
            expert_cache, self.expert_cache_reason = asked_auto_cache(self.container, pinned=not split,
                                                                      kv_bytes=kv_bytes, lend_kv=not split)
        self.expert_cache_reason += fitted if self.expert_cache_reason else ""
        if announce is not None and self.expert_cache_reason:
            announce(self.expert_cache_reason)
        if expert_cache and discrete and not split:
            raise GlmkitError("--expert-cache: this discrete GPU holds every weight it runs (the cache serves the "
                              "routed experts a GPU smaller than the model leaves to a CPU OpenCL device beside it)")
        if expert_cache and ram_budget_bytes:
            raise GlmkitError("--expert-cache and --ram-budget both keep experts in RAM: give one of them")
        if expert_cache and split:  # the model reads the mapping (uploads, prefill); the split step's CPU side reads
            # the cache, whose scores start from the saved ones (the split step's own are saved on close)
            self.experts = ExpertStreamer(self.container, 0, prefetch)
            self.step_cache = ExpertCache(self.container, int(expert_cache), readahead=prefetch,
                                          scores=copy.deepcopy(self.expert_usage), pin_weights=False)
            self.model = GlmMoeDsaModel(self.config, self.experts, self.backend, route_hook=self.experts.on_route,
                                        step_experts=self.step_cache, kv_dtype=kv_dtype)
        elif expert_cache:
            # sized from the RAM: the room kept for the KV rows is the cache's too while the rows leave it empty
            lent = lendable_bytes(self.container, int(expert_cache), kv_bytes) if self.expert_cache_reason else 0
            cache = self.experts = ExpertCache(self.container, int(expert_cache) + lent, readahead=prefetch,
                                               usage_file=self.usage_file, scores=self.expert_usage,
                                               lendable_bytes=lent)
            self.model = model_over_expert_cache(self.config, cache, self.backend, kv_dtype, lend=bool(lent))
        else:
            self.experts, self.model = model_over_page_cache(self.container, self.config, self.backend, kv_dtype,
                                                             prefetch, ram_budget_bytes)
        if expert_cache and not split:  # each forward reads its routed experts once a layer: long prompts go layer
            # by layer in spans as long as the activations' room allows (sized from the RAM: what the cache left)
            self.model.span_rows, self.model.prefill_rows = span_rows_within(
                self.config, activation_allowance(memory_limit_bytes()))
        # the device decode step (if any) is built now, with the model, not inside the first prompt's time to token
        self.model.decodes_on_device()
        if expert_cache and self.expert_cache_reason:
            self.kv_budget_tokens = self.model.kv_room_tokens = self.config.max_position_embeddings
        elif expert_cache and not split:  # sized by hand: the KV rows get what the RAM leaves beside all of it
            # the cache is in what the process holds, but for the slots no read has filled yet
            room = max(0, room_for_cache(self.container, None, pinned=False)[1] - self.experts.untaken_bytes())
            self.kv_budget_tokens = self.model.kv_room_tokens = min(
                self.config.max_position_embeddings, room // kv_bytes_per_token(self.config, kv_dtype))

    @property
    def expert_stats(self) -> CacheStats | ExpertStats:
        """The routed experts' counters `--stats-json` reports: the expert cache's (the split step's CPU side's where
        it has one), else the page cache's."""
        return self.step_cache.stats if self.step_cache is not None else self.experts.stats

    def close(self) -> None:
        """Let the expert cache finish its reads and save its usage scores, or save the split step's (nothing to do
        otherwise)."""
        if self.step_cache is not None:
            self.step_cache.close()
        if isinstance(getattr(self, "experts", None), ExpertCache):  # set unless opening failed before it
            self.experts.close()
        elif self.usage_file is not None and self.expert_usage.tokens:  # a split step counted decoded tokens
            save_scores(self.usage_file, self.container.model_hash, self.expert_usage)

    @property
    def model_hash(self) -> str:
        return self.container.model_hash

    def use_mtp(self, force_on: bool, off: bool) -> bool:
        """MTP speculative decoding for `--mtp` / `--no-mtp`, else by default: on where single tokens decode
        operation by operation; where they decode as one device step, on where a draft's verification and the next
        draft (one device step too) cost less than two single tokens, as measured on this device (`mtp_costs`).
        Then a generation whose first drafts are accepted too rarely to pay turns MTP off for its remaining tokens
        (`GlmMoeDsaModel.mtp_break_even`)."""
        if force_on or off:
            return force_on
        if not self.model.has_mtp:
            return False
        if not self.model.decodes_on_device():
            return True
        if not self.model.drafts_on_device():
            return False
        costs = self.mtp_costs()
        self.model.mtp_break_even = costs["cycle"] / costs["token"] - 1
        return self.model.mtp_break_even < 1

    def use_batching(self) -> bool:
        """Whether glm-serve batches decoding requests by default: where `GlmMoeDsaModel.batch_pays` (the batch through
        the operations, or the device decode step over several sequences) and, on the device step, where a forward of
        two sequences costs less per token than single-token forwards, as measured on this device (`batch_costs`)."""
        if not self.model.batch_pays():
            return False
        if not self.model.decodes_on_device():
            return True
        costs = self.batch_costs()
        return costs["batch"] < costs["token"]

    def batch_costs(self) -> dict[str, float]:
        """ms per token of a single-token forward ("token") and of a forward of two sequences ("batch") on this
        model's device steps: measured once per device and model (`measure_batch_costs`), kept in the device's
        profile."""
        from glmkit.backends.devices import stored_measurement

        return stored_measurement(self.backend.k.info, self.container, self._measurement_name("batch_ms"),
                                  ("batch", "token"), lambda: measure_batch_costs(self.model))

    def mtp_costs(self) -> dict[str, float]:
        """ms of one single decoded token (pipelined, "token") and of one MTP verification with its draft
        ("cycle") on this model's device steps: measured once per device and model (`measure_mtp_costs`), kept in
        the device's profile."""
        from glmkit.backends.devices import stored_measurement

        return stored_measurement(self.backend.k.info, self.container, self._measurement_name("mtp_ms"),
                                  ("cycle", "token"), lambda: measure_mtp_costs(self.model))

    def _measurement_name(self, name: str) -> str:
        """A device-step timing's name in the device profile: its own over an expert cache, whose forwards wait for
        expert reads the mapping's do not."""
        return name if self.model.step_experts is None else f"{name}_expert_cache"


MEASURE_BUDGET_S = 20.0  # seconds a device-step cost measurement aims to spend timing (beyond its warm-up runs)


def _probe_prompt_length(cfg: ModelConfig) -> int:
    """Tokens of the random prompts the cost measurements decode after: past index_topk where it is small (so that the
    indexer selects), at most 64."""
    return min(cfg.index_topk + 16, 64, cfg.max_position_embeddings // 2)


def _timed_runs(rounds: int, runs: int, per_run_s: float, budget_s: float) -> int:
    """Rounds of `runs` timed runs each that fit `budget_s` at `per_run_s` a run (at least 1, at most `rounds`)."""
    return max(1, min(rounds, int(budget_s / max(runs * per_run_s, 1e-9))))


def measure_batch_costs(model: GlmMoeDsaModel, rounds: int = 3, tokens: int = 4,
                        budget_s: float = MEASURE_BUDGET_S) -> dict[str, float]:
    """`Engine.batch_costs` measured now: two caches of random prompt tokens (`_probe_prompt_length`), ms per token of
    single-token forwards of one of them ("token": the single-row step, as one request per pass decodes) and of
    `decode_batch` forwards of both ("batch": the step over two sequences), the medians of `rounds` alternations of
    `tokens` forwards each (after one more, untimed: its time decides how many rounds fit `budget_s`, at least one);
    the caches are cut back to their prompts after each."""
    cfg = model.config
    length = _probe_prompt_length(cfg)
    rng = np.random.default_rng(0)
    caches = [model.new_cache() for _ in range(2)]
    for cache in caches:
        model.forward(rng.integers(0, cfg.vocab_size, length), cache)

    def forwards(rows: int) -> float:  # seconds of `tokens` forwards of `rows` sequences
        start = time.perf_counter()
        for _ in range(tokens):
            model.decode_batch(np.full(rows, 5), caches[:rows])
        spent = time.perf_counter() - start
        for cache in caches:
            cache.truncate(length)
        return spent

    warm = forwards(1) + forwards(2)  # kernel builds, the step over two sequences
    costs: dict[str, list[float]] = {"token": [], "batch": []}
    for _ in range(_timed_runs(rounds, 1, warm, budget_s)):
        for name, rows in (("token", 1), ("batch", 2)):
            costs[name].append(forwards(rows) * 1e3 / (tokens * rows))
    return {name: round(float(np.median(values)), 4) for name, values in costs.items()}


def measure_mtp_costs(model: GlmMoeDsaModel, rounds: int = 5, tokens: int = 24,
                      budget_s: float = MEASURE_BUDGET_S) -> dict[str, float]:
    """`Engine.mtp_costs` measured now, as `Generator` decodes greedily after random prompt tokens
    (`_probe_prompt_length`, prefilled once per mode: each run continues from it): ms per decoded token with MTP
    off ("token", the pipelined step) and per main forward with MTP on ("cycle": a verification with its draft, the
    host's work between them included), the medians of `rounds` alternations of `tokens` tokens each (after one
    more, untimed). A short run of each first (kernel builds, first launches) gives a token's time: where decoding is
    slow (a model streaming its experts from disk) the runs are shorter (at least 4 tokens) and fewer (at least one
    alternation) so that the timed ones fit about `budget_s`."""
    from glmkit.generate.generator import GenerationStats, Generator
    from glmkit.generate.sampling import Sampler, SamplingParams

    cfg = model.config
    length = _probe_prompt_length(cfg)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, length).tolist()
    caches = {use_mtp: model.new_cache() for use_mtp in (False, True)}  # MTP's own: its layer's rows stay in step

    def decode(use_mtp: bool, n: int) -> GenerationStats:  # n tokens after one more (its forward is not timed)
        generator = Generator(model, (), use_mtp=use_mtp)
        for _token in generator.generate(prompt, n + 1, Sampler(SamplingParams()), caches[use_mtp]):
            pass
        caches[use_mtp].truncate(length)
        return generator.stats

    warm = [decode(use_mtp, 2) for use_mtp in (False, True)]
    per_token = max(stats.decode_s / 2 for stats in warm)
    tokens = max(4, min(tokens, int(budget_s / (2 * rounds * per_token))))
    costs: dict[str, list[float]] = {"token": [], "cycle": []}
    for _ in range(_timed_runs(rounds, 2, tokens * per_token, budget_s)):
        for use_mtp in (False, True):
            stats = decode(use_mtp, tokens)
            costs["cycle" if use_mtp else "token"].append(stats.decode_s * 1e3 / stats.main_forwards)
    return {name: round(float(np.median(values)), 4) for name, values in costs.items()}


def model_over_expert_cache(config: ModelConfig, cache: ExpertCache, backend: Backend, kv_dtype: str,
                            lend: bool = False) -> GlmMoeDsaModel:
    """The model reading its routed experts from `cache`'s slots (its hooks: routes, read-ahead, experts run; with
    `lend`, the KV rows' room it lends)."""
    return GlmMoeDsaModel(config, cache, backend, route_hook=cache.on_route, step_experts=cache, kv_dtype=kv_dtype,
                          ahead_hook=cache.read_ahead, ran_hook=cache.ran, lend_hook=cache.lend if lend else None)


def model_over_page_cache(container: Container, config: ModelConfig, backend: Backend, kv_dtype: str,
                          prefetch: bool, ram_budget_bytes: int = 0, layers: range | None = None
                          ) -> tuple[ExpertStreamer, GlmMoeDsaModel]:
    """The model reading its routed experts through the page cache (`ram_budget_bytes` of them pinned), with its
    weight source. With `prefetch`, where the container (with `layers`: their part) outgrows the RAM, a device decode
    step's routed experts are advised as it routes them (its callbacks cost a large share of decode when everything
    is in RAM: docs/BENCHMARKS.md); else all of it is read into the page cache in the background."""
    experts = ExpertStreamer(container, ram_budget_bytes, prefetch)
    watch = prefetch and outgrows_memory(container, layers=layers)
    model = GlmMoeDsaModel(config, experts, backend, route_hook=experts.on_route,
                           step_route_hook=experts.advise_routed if watch else None, kv_dtype=kv_dtype)
    if prefetch and not watch:
        experts.warm_in_background(layers)
    return experts, model


def context_config(config: ModelConfig, max_context: int | None) -> ModelConfig:
    """`config` with at most `max_context` positions (None: as it is); a GlmkitError past the model's own."""
    if max_context is None:
        return config
    if not 1 <= max_context <= config.max_position_embeddings:
        raise GlmkitError(f"--max-context {max_context}: must be in 1..{config.max_position_embeddings} (the model's "
                          f"max_position_embeddings)")
    return dataclasses.replace(config, max_position_embeddings=max_context)


def fitted_context(container: Container, config: ModelConfig, kv_dtype: str, asked: bool = False
                   ) -> tuple[ModelConfig, str]:
    """`config` as an expert cache sized from the RAM runs it (`asked`: --expert-cache auto; else where the container
    outgrows the RAM): where the KV rows of its whole context would leave no room beside them for two layers' routed
    experts, with the context the positions whose rows leave it (`context_beside_cache`; where the RAM holds not even
    the experts, unchanged: the page cache). With what the log adds ('' where unchanged)."""
    if not (asked or outgrows_memory(container)):
        return config, ""
    whole = config.max_position_embeddings
    fits = context_beside_cache(container, kv_bytes_per_token(config, kv_dtype))
    if not 0 < fits < whole:
        return config, ""
    return context_config(config, fits), (f"; context {fits:,} positions of the model's {whole:,}: the KV rows that "
                                          f"fit beside two layers' experts (--max-context, --kv-dtype)")


def asked_auto_cache(container: Container, where: str = "", **sizing: Any) -> tuple[int, str]:
    """`--expert-cache auto`: (the bytes `auto_cache_bytes` gives with `sizing`, "expert cache " and why); a
    GlmkitError (naming `where`, e.g. a pipeline stage, where given) when the RAM leaves nothing for experts."""
    size, why = auto_cache_bytes(container, **sizing)
    if size == 0:
        raise GlmkitError(f"--expert-cache auto: {where}{': ' if where else ''}no RAM left for experts ({why})")
    return size, f"expert cache {why}"


def default_expert_cache(container: Container, pinned: bool = True, kv_bytes: int = 0, lend_kv: bool = False,
                         layers: range | None = None, activations: int | None = None) -> tuple[int, str]:
    """Where the container's routed experts live by default: (the bytes of an expert cache, or 0 for the page
    cache; why, in one line). A cache where the container outgrows the RAM the process may use and that RAM still
    holds one layer's routed experts (`pinned`, `kv_bytes`, `lend_kv`, `layers`, `activations`: as
    `auto_cache_bytes`; with `layers`, where their part of the container outgrows it)."""
    if layers is None:
        nbytes, what = container.nbytes, "the container"
    else:
        nbytes, what = container.layers_nbytes(layers), f"layers {layers.start}-{layers.stop - 1}"
    if not routed_expert_bytes(container, layers) or not outgrows_memory(container, layers=layers):
        return 0, (f"routed experts in the page cache: {what} ({format_size(nbytes)}) fits the "
                   f"{format_size(memory_limit_bytes())} the process may use")
    size, why = auto_cache_bytes(container, pinned=pinned, kv_bytes=kv_bytes, lend_kv=lend_kv, layers=layers,
                                 activations=activations)
    if size < container.config.num_experts_per_tok * expert_slot_bytes(container):
        return 0, f"routed experts in the page cache: an expert cache would get {why}, less than one layer's"
    return size, f"expert cache {why}"


def _eos_ids(snapshot: Path, from_config: tuple[int, ...]) -> tuple[int, ...]:
    """Every eos id from config.json and generation_config.json."""
    ids = set(from_config)
    path = snapshot / "generation_config.json"
    if path.is_file():
        eos = read_side_json(path).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(i for i in eos if isinstance(i, int))
    return tuple(sorted(ids))
