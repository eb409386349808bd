"""Token generation: prefill, then decode, with MTP speculative decoding when the model has an MTP layer.

MTP scheme (one draft token): after the main model emits `t` at position p, the MTP layer has seen
every confirmed `(h_i, t_{i+1})` pair and drafts `d` for position p+1. The next main forward takes
`[t, d]`: its first row gives the real token at p+1; if that equals `d`, the second row is already
the main model's prediction for p+2 (two tokens from one forward), otherwise the draft's KV row is
dropped. Every emitted token is sampled from the main model's logits, so greedy output is identical
with and without MTP, and sampled output follows the same distribution.

Decoding without MTP on a backend with a device decode step (OpenCL) keeps the next forward in flight: the
device picks each token (the argmax, or a sampled draw from a uniform the host drew from the sampler's stream in
advance; with a constraint, among the tokens its bitmask allows, which the host writes while the forward before
runs) and queues its forward before the host sees it (`GlmMoeDsaModel.pipelined_decode`), with the same tokens
and the same cache at the end. A sampler that needs the logits on the host (penalties or biases, logprobs), or a
constraint where the device cannot mask, decodes one token at a time.

A short prompt (piece) on such a backend is prefilled through the decode step as well (`forward_prompt`: one or two
tokens per forward), its forwards queued back to back and only the last one's logits computed: a batched forward
of a few rows dequantizes each expert it routes to for a few rows, which costs more than reading them as the step
does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from glmkit.generate.sampling import Sampler
from glmkit.model.glm5 import VERIFY_ROWS, GlmMoeDsaModel
from glmkit.model.kv_cache import KVCache

MTP_PROBE_DRAFTS = 16  # drafts after which a generation compares its acceptance with the model's break-even
PREFILL_CHUNK = 2048  # prompt tokens per forward: a long prompt's temporaries stay those of one chunk
DECODE_RESERVE = 4096  # KV rows made room for after the prompt, at most
# KV rows a decoding sequence holds past those it has (`GlmMoeDsaModel.hold_kv_rows`): an expert cache lending the
# rows' room gives it back in steps of this many as the reply grows, not a whole max_tokens' worth before it starts
KV_HOLD_AHEAD = 256
STEP_PREFILL_ROWS = 48  # prompt pieces up to this many tokens go through the decode step (one or two tokens a forward)


def forward_prompt(model: GlmMoeDsaModel, ids: np.ndarray, cache: KVCache, step_rows: int = STEP_PREFILL_ROWS,
                   queued: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Prompt tokens `ids [S]` appended at `cache.length..`: (the last position's logits `[1, V]`, hidden `[S, H]`
    after the final norm). Up to `step_rows` tokens run through the device decode step where single tokens run as it,
    the forwards queued back to back unless not `queued` (`GlmMoeDsaModel.prefill_on_step`), else one batched
    forward."""
    if not 1 < len(ids) <= step_rows or not model.decodes_on_device():
        return model.forward(ids, cache, last_logits_only=True)
    return model.prefill_on_step(ids, cache, queued)


def prefill_part(model: GlmMoeDsaModel, prompt_ids: Sequence[int], end: int, cache: KVCache, use_mtp: bool,
                 step_rows: int = STEP_PREFILL_ROWS, queued: bool = True) -> None:
    """Append the prompt tokens `prompt_ids[cache.length:end]` (not its last one: no logits are made), and give the MTP
    layer their rows too when it has kept up (drafting needs every position). step_rows, queued: see
    `forward_prompt`."""
    start = cache.length
    _, hidden = forward_prompt(model, np.asarray(prompt_ids[start:end], dtype=np.int64), cache, step_rows, queued)
    mtp = cache.layer(model.config.num_hidden_layers)
    if use_mtp and mtp.length == start:
        model.mtp_forward(hidden, np.asarray(prompt_ids[start + 1:end + 1], dtype=np.int64), cache)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    main_forwards: int = 0  # decode-phase forwards of the main model
    mtp_drafts: int = 0
    mtp_accepted: int = 0
    stop_reason: str = ""
    _start: float = field(default=0.0, repr=False)

    @property
    def mtp_acceptance(self) -> float | None:
        return self.mtp_accepted / self.mtp_drafts if self.mtp_drafts else None

    @property
    def tokens_per_forward(self) -> float | None:
        """Decode tokens per main-model forward (1.0 without MTP), the first token excluded."""
        return (self.decode_tokens - 1) / self.main_forwards if self.main_forwards else None


class Generator:
    """Runs one sequence: `generate(prompt_ids, ...)` yields token ids as they are decided."""

    def __init__(self, model: GlmMoeDsaModel, eos_token_ids: tuple[int, ...] = (), use_mtp: bool = True,
                 prefill_chunk: int = PREFILL_CHUNK, checkpoint: Callable[[list[int]], None] | None = None,
                 pipelined: bool = True, step_prefill: int = STEP_PREFILL_ROWS, queue_prompt: bool = True,
                 holds_kv: bool = True):
        """prefill_chunk: prompt tokens per forward; checkpoint(prompt_ids): called after each prompt chunk but the
        last, the cache then holding `prompt_ids[:cache.length]` (glm-run stores them in the prefix cache, so that a
        long prefill killed half way resumes there); pipelined: False decodes one token at a time even where the
        device could choose the tokens (the same tokens; tools/bench_sampling.py compares the two); step_prefill:
        prompt pieces up to this many tokens run through the decode step (`forward_prompt`; 0: never); queue_prompt:
        False runs them one token per forward, each waiting for its logits before the next is queued (the same rows;
        tools/bench.py compares the two); holds_kv: the sequence is the model's only one, so each generation tells
        the model the rows it may come to hold (`GlmMoeDsaModel.hold_kv_rows`; False where a scheduler does it for all
        of its sequences)."""
        self.model = model
        self.holds_kv = holds_kv
        self.pipelined = pipelined
        self.prefill_chunk = prefill_chunk
        self.step_prefill = step_prefill
        self.queue_prompt = queue_prompt
        self.checkpoint = checkpoint
        self.eos = set(eos_token_ids)
        self.use_mtp = use_mtp and model.has_mtp
        self.stats = GenerationStats()

    def generate(self, prompt_ids: list[int], max_tokens: int, sampler: Sampler,
                 cache: KVCache | None = None) -> Iterator[int]:
        """Yield up to `max_tokens` new tokens (stopping after an eos id, which is yielded too).

        `cache` may already hold a prefix of `prompt_ids` (a chat history): only the rest is prefilled.
        """
        cache = cache if cache is not None else self.model.new_cache()
        stats = self.stats = GenerationStats(prompt_tokens=len(prompt_ids), cached_tokens=cache.length)
        start = time.perf_counter()
        if max_tokens <= 0:
            stats.stop_reason = "length"
            return
        most = min(len(prompt_ids) + max_tokens, self.model.config.max_position_embeddings)  # the rows it may hold
        held = min(len(prompt_ids) + KV_HOLD_AHEAD, most)
        if self.holds_kv:
            self.model.hold_kv_rows(held)
        # room for the prompt and the first tokens: a long prompt's rows are not copied as the arrays grow
        rows = len(prompt_ids) + min(max_tokens, DECODE_RESERVE) + 1
        cache.reserve(min(rows, self.model.config.max_position_embeddings))
        if cache.length == len(prompt_ids):  # the whole prompt is cached: recompute its last token to get logits
            cache.truncate(cache.length - 1)
        chunk = self.model.prompt_chunk(self.prefill_chunk, most)
        while len(prompt_ids) - cache.length > chunk:  # chunks end at multiples of `chunk`: the same rounding however
            prefill_part(self.model, prompt_ids, (cache.length // chunk + 1) * chunk, cache, self.use_mtp,  # it began
                         self.step_prefill, self.queue_prompt)
            if self.checkpoint is not None:
                self.checkpoint(prompt_ids)
        logits, hidden = forward_prompt(self.model, np.asarray(prompt_ids[cache.length:], dtype=np.int64), cache,
                                        self.step_prefill, self.queue_prompt)
        token = sampler(logits[-1])
        draft = None
        if self.use_mtp:
            # MTP rows exist for every position whose next token is known; catch up on the prompt's (the MTP
            # layer's prefill: before the first token is yielded)
            draft = self._mtp_catch_up(prompt_ids, hidden, token, cache)
        stats.prefill_s = stats.ttft_s = time.perf_counter() - start
        decode_start = time.perf_counter()
        emitted = 0
        pipe = None  # decoding with the next forward in flight (the device decode step)
        # tried once; off again once the pipe stops
        pipelined = self.pipelined and not sampler.host_only and not self.use_mtp
        on_device = self.use_mtp and self.model.drafts_on_device()  # verification and drafts as one device step
        mtp_kept: int | None = None
        try:
            while True:
                # stats are final before each yield: a consumer may stop iterating at an eos token
                emitted += 1
                self._count(stats, emitted, token, decode_start)
                yield token
                if token in self.eos:
                    return
                if emitted >= max_tokens:
                    stats.stop_reason = "length"
                    return
                if cache.length - (pipe.ahead if pipe else 0) + 1 >= self.model.config.max_position_embeddings:
                    stats.stop_reason = "context"
                    return
                if self.holds_kv and held < most and cache.length + VERIFY_ROWS >= held:  # the next rows would
                    held = min(cache.length + KV_HOLD_AHEAD, most)  # pass those held
                    self.model.hold_kv_rows(held)
                if draft is None:
                    if pipe is None and pipelined:
                        pipelined = False
                        pipe = self.model.pipelined_decode(token, cache, None if sampler.greedy else sampler,
                                                           sampler.constraint)
                    if pipe is not None:
                        token = pipe.advance()
                        if pipe.stopped:
                            pipe = None
                    else:
                        logits, _ = self.model.forward(np.array([token]), cache)
                        token = sampler(logits[-1])
                    stats.main_forwards += 1
                    continue
                # verify the draft: one forward over [token, draft] (on the device: the next drafts in its queue)
                base = cache.length
                fused = None
                if on_device:
                    logits, hidden, fused = self.model.verify_draft(np.array([token, draft]), cache, sampler.greedy)
                else:
                    logits, hidden = self.model.forward(np.array([token, draft]), cache)
                stats.main_forwards += 1
                stats.mtp_drafts += 1
                nxt = sampler(logits[0])
                # accepting also emits `after`, the token for position base + 2: it must fit the limits too
                room = emitted + 1 < max_tokens and base + 2 < self.model.config.max_position_embeddings
                if nxt == draft and room and nxt not in self.eos:
                    stats.mtp_accepted += 1
                    emitted += 1
                    self._count(stats, emitted, nxt, decode_start)
                    mtp_kept = base  # the MTP layer's rows while `after` is not chosen: as it had before them
                    yield nxt
                    mtp_kept = None
                    after = sampler(logits[1])
                    draft = self._next_draft(hidden, [nxt, after], cache, base, fused)
                    token = after
                else:
                    if nxt == draft:
                        stats.mtp_accepted += 1
                    cache.truncate(base + 1)  # drop the draft's row
                    draft = self._next_draft(hidden[:1], [nxt], cache, base, fused)
                    token = nxt
                break_even = self.model.mtp_break_even
                if stats.mtp_drafts == MTP_PROBE_DRAFTS and break_even is not None and (
                        stats.mtp_accepted < break_even * stats.mtp_drafts):
                    draft = None  # too few accepted to pay on this device: single tokens from here on
                    pipelined = self.pipelined and not sampler.host_only
        finally:
            if pipe is not None:
                pipe.close()  # the cache keeps no row past the last token yielded
            if mtp_kept is not None:  # stopped at `nxt`: no MTP rows for the fused queue's unchosen `after`
                cache.layer(self.model.config.num_hidden_layers).truncate(mtp_kept)

    def _count(self, stats: GenerationStats, emitted: int, token: int, decode_start: float) -> None:
        stats.decode_tokens = emitted
        stats.decode_s = time.perf_counter() - decode_start
        if token in self.eos:
            stats.stop_reason = "eos"

    def _mtp_catch_up(self, prompt_ids: list[int], hidden: np.ndarray, token: int, cache: KVCache) -> int | None:
        """Feed the MTP layer the prompt positions it has not seen; returns the first draft.

        The MTP layer's KV row i pairs `h_i` with `t_{i+1}`. A reused cache whose MTP rows stop before the
        newly computed positions leaves a gap that cannot be filled from KV rows alone: no drafts then.
        """
        mtp = cache.layer(self.model.config.num_hidden_layers)
        first = len(prompt_ids) - len(hidden)  # position of hidden[0]
        if mtp.length != first:
            return None
        return self._mtp_step(hidden, list(prompt_ids[first + 1:]) + [token], cache)

    def _next_draft(self, hidden: np.ndarray, chosen: list[int], cache: KVCache, base: int,
                    fused: tuple[np.ndarray, np.ndarray] | None) -> int:
        """The draft after the verified rows kept (`hidden [n, H]`, the tokens `chosen` for them, from position
        `base`): the device queue's own (`fused`: its greedy tokens and drafts) when it chose these tokens, else
        the MTP head run on them (on the device step where it drafts)."""
        mtp, n = cache.layer(self.model.config.num_hidden_layers), len(chosen)
        if fused is not None and fused[0][:n].tolist() == chosen:
            mtp.truncate(base + n)
            return int(fused[1][n - 1])
        if fused is None and not self.model.drafts_on_device():
            return self._mtp_step(hidden, chosen, cache)
        mtp.truncate(base)
        spare = np.minimum(np.arange(VERIFY_ROWS), n - 1)  # rows past the kept ones: a copy of the last, then dropped
        drafts = self.model.redraft([chosen[i] for i in spare], hidden[spare], cache)
        mtp.truncate(base + n)
        return int(drafts[n - 1])

    def _mtp_step(self, hidden: np.ndarray, next_ids: list[int], cache: KVCache) -> int:
        logits, _ = self.model.mtp_forward(hidden, np.asarray(next_ids, dtype=np.int64), cache)
        return int(np.argmax(logits[-1]))
