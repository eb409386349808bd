"""The generation worker: one thread runs every request's steps over a pool of Sessions, with continuous batching.

A step is one unit of work of one request: restoring its cached prefix, one chunk of its prefill
(`prefill_chunk` tokens), or one decode step. Every pass over the active requests gives each of them one step, so a
long prompt does not stall the other conversations' decoding for more than one chunk, and a request that is
cancelled (its client went away) stops at its next step.

Decode steps are batched: when two or more requests are decoding, one pass decodes all of them (`max_batch` per
forward) in one `GlmMoeDsaModel.decode_batch` forward, each row sampled by its request's own Sampler (constraint,
penalties, logprobs, seed); a request that finishes its prefill joins the batch on the next pass, one that ends
leaves it. A request decoding alone runs its `Generator` (`next()`: one forward, an already verified MTP token, the
device decode step with its next forward in flight). Joining the batch closes that generator (its cache keeps the
rows of the tokens given out so far, the last one's row not yet written); decoding alone again starts a new
generator on the prompt plus the tokens so far, whose "prefill" is the last token's single-row forward. Batched rows
run no MTP drafts, and such a request drafts nothing after it (its MTP rows fell behind). A batch whose rows the
device's memory cannot hold at once (`DeviceMemoryError`: a discrete GPU's copies of their KV rows) is not lost: its
caches are rolled back and from then on batches hold at most half as many rows (at 1, each request decodes alone).

Where the engine budgets its memory (`Engine.kv_budget_tokens`: an expert cache sized from the RAM left room for
that many KV rows), a queued request starts only once every Session's rows and the active requests' most (prompt and
`max_tokens`) leave room for its own most; idle Sessions give up their rows first (the prefix cache keeps what was
stored), else it waits for active requests to end.

Every request goes through `Session.prepare` / `Session.commit` exactly like `glm-run --chat`: a
request takes the idle Session whose KV rows share the longest prefix with its prompt (so a
conversation's follow-up turn finds its own history in process memory), and the on-disk prefix cache
covers everything else (another Session's conversation, an earlier process). All model, Session and
prefix-cache work happens on the worker thread (the sqlite index is opened there too).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from glmkit.cache.prefix_cache import PrefixCache, common_prefix
from glmkit.cache.session import ReuseStats, Session
from glmkit.errors import DeviceMemoryError
from glmkit.generate.engine import Engine
from glmkit.generate.generator import KV_HOLD_AHEAD, Generator, prefill_part
from glmkit.generate.sampling import LogitsConstraint, Sampler, SamplingParams, TokenLogprob
from glmkit.generate.tokenizer import StreamDecoder
from glmkit.model.compute import PipelinedRows

log = logging.getLogger("glmkit.serve")

RECENT = 256  # finished requests kept for /stats


@dataclass
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    request_id: str = ""
    constraint: LogitsConstraint | None = None  # the tokens each step may choose from (a grammar's mask)
    logprobs: int | None = None  # report each token's log-probability and this many likeliest (None: none)


@dataclass
class Text:
    """New generated text (valid UTF-8 up to here, stop sequences held back); with logprobs requested, those of the
    tokens generated since the last Text."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Done:
    """The request ended: `finish_reason` is stop | length | cancelled | error."""

    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cached_from: dict[str, int]
    queue_s: float
    ttft_s: float | None  # from submission to the first token
    prefill_s: float | None  # from leaving the queue to the first token
    decode_s: float
    restore_s: float = 0.0  # finding and loading the cached prefix (Session.prepare), part of prefill_s
    error: str = ""
    stop_sequence: str | None = None  # the request's stop sequence that ended it (None: eos, length, ...)

    def record(self, request_id: str) -> dict[str, Any]:
        rounded = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}
        return {"id": request_id, **rounded}


class QueueFull(Exception):
    pass


class GenerationJob:
    def __init__(self, request: GenRequest, emit: Callable[[Text | Done], None]):
        self.request = request
        self.emit = emit
        self.cancelled = False  # set from any thread; the worker checks it before every step
        self.submitted = time.perf_counter()
        # worker-only state
        self.session: Session | None = None
        self.generator: Generator | None = None
        self.iterator: Any = None
        self.decoder: StreamDecoder | None = None
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0  # characters of `text` emitted
        self.stop_hit: str | None = None  # the stop sequence found in `text`
        self.sampler: Sampler | None = None
        self.logprobs_sent = 0  # of the sampler's chosen tokens' logprobs, those sent with a Text
        self.cached = 0
        self.reuse = ReuseStats()
        self.restore_s = 0.0
        self.started = 0.0
        self.first_token = 0.0
        self.batched = False  # decoding in the batch: no generator; the cache lacks the last token's row

    @property
    def decoding(self) -> bool:
        """Prefilled: its first token is out."""
        return self.iterator is not None or self.batched


class Scheduler:
    def __init__(self, engine: Engine, *, prefix_cache: Callable[[], PrefixCache | None] | None = None,
                 use_mtp: bool = True, reuse: bool = True, max_active: int = 4, max_queue: int = 64,
                 prefill_chunk: int = 512, max_batch: int | None = None):
        """prefix_cache: opens the on-disk cache (called on the worker thread; None = no disk cache).
        reuse: False = every request prefills its whole prompt (no Session reuse, no disk cache).
        max_batch: decoding requests per batched forward (1: each decodes on its own, one step each in turn; None:
        max_active where batching pays, `Engine.use_batching`, else 1). A model whose forwards take one
        sequence (a Ray pipeline's) never batches."""
        self.engine = engine
        self.use_mtp = use_mtp and engine.model.has_mtp
        self.reuse = reuse
        self.max_active = max(1, max_active)
        self.max_queue = max_queue
        self.prefill_chunk = max(1, prefill_chunk)
        self._max_batch = max_batch
        self.max_batch = 1  # decided on the worker thread (whether the model decodes on a device step)
        # (the size a batch was halved to, the fewest KV rows' room a batch was found not to fit the device with)
        self._unfit: tuple[int, int] | None = None
        self._open_cache = prefix_cache if reuse else None
        self.prefix_cache: PrefixCache | None = None
        self._cv = threading.Condition()
        self._queue: collections.deque[GenerationJob] = collections.deque()
        self._active: list[GenerationJob] = []
        self._sessions: list[Session] = []
        self._idle: list[Session] = []  # least recently used first
        self._prompt_len: dict[Session, int] = {}  # idle Session -> length of the prompt it last served
        self._stopping = False
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self.counters = {"requests": 0, "completed": 0, "cancelled": 0, "failed": 0, "rejected": 0,
                         "prompt_tokens": 0, "cached_tokens": 0, "prefill_tokens": 0, "completion_tokens": 0,
                         "steps": 0, "max_active_seen": 0, "batched_forwards": 0, "batched_rows": 0,
                         "max_batch_seen": 0, "batch_shrunk": 0, "pipelined_forwards": 0}
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT)
        # the batch decoding with its next forward in flight, and its requests in its row order
        self._pipe: PipelinedRows | None = None
        self._pipe_jobs: list[GenerationJob] = []
        self._thread = threading.Thread(target=self._run, name="glm-serve-worker", daemon=True)

    # ---- any thread ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker; raises what opening the prefix cache raised."""
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def submit(self, request: GenRequest, emit: Callable[[Text | Done], None]) -> GenerationJob:
        job = GenerationJob(request, emit)
        with self._cv:
            if len(self._queue) + len(self._active) >= self.max_active + self.max_queue:
                self.counters["rejected"] += 1
                raise QueueFull(f"{len(self._active)} requests running and {len(self._queue)} waiting")
            self.counters["requests"] += 1
            self._queue.append(job)
            self._cv.notify()
        return job

    def cancel(self, job: GenerationJob) -> None:
        job.cancelled = True
        with self._cv:
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def stats(self) -> dict[str, Any]:
        with self._cv:
            return {**self.counters, "active": len(self._active), "queued": len(self._queue),
                    "sessions": len(self._sessions), "max_active": self.max_active, "max_batch": self.max_batch,
                    "recent": list(self.recent)}

    # ---- worker thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.prefix_cache = self._open_cache() if self._open_cache else None
            model = self.engine.model
            wanted = self.max_active if self._max_batch is None and self.engine.use_batching() else self._max_batch or 1
            self.max_batch = max(1, min(wanted, self.max_active)) if model.batches_sequences else 1
        except BaseException as e:  # reported by start()
            self._startup_error = e
            self._ready.set()
            return
        self._ready.set()
        while True:
            with self._cv:
                while not self._stopping and not self._active and not self._queue:
                    self._cv.wait()
                if self._stopping:
                    break
                while self._queue and len(self._active) < self.max_active and not self._waits(self._queue[0]):
                    job = self._queue.popleft()
                    own = self._reusable(job.request.prompt_ids)
                    self._make_room(job, own)
                    job.session = self._acquire(own)
                    job.started = time.perf_counter()
                    self._active.append(job)
                self.counters["max_active_seen"] = max(self.counters["max_active_seen"], len(self._active))
                jobs = list(self._active)
            self._hold_pass_rows()  # before any step grows the rows
            decoding = [job for job in jobs if job.decoding]
            size = self._batch_size(decoding)
            if len(decoding) < 2 or size < 2:
                decoding = []  # decoding alone: its generator's own steps
            for job in jobs:  # one step each; the decoding ones together after the prefill steps
                if job not in decoding:
                    self._step(job)
            for at in range(0, len(decoding), size):  # one batch a pass may keep its next forward queued
                self._batch_step(decoding[at:at + size], pipelined=len(decoding) <= size)
        for job in list(self._active) + list(self._queue):
            job.cancelled = True
            self._finish(job, "cancelled")

    def _batch_size(self, decoding: list[GenerationJob]) -> int:
        """Requests per batched forward this pass: `max_batch`, or where a batch whose caches held room for as many KV
        rows as those of the first `max_batch` of `decoding` did not fit the device (a discrete GPU's room for the
        rows' copies, which take a cache's whole arrays), the size it was halved to; once the requests hold less
        (long ones ended), full batches again."""
        if self._unfit is None:
            return self.max_batch
        size, rows = self._unfit
        held = sum(job.session.kv.capacity for job in decoding[:self.max_batch])  # type: ignore[union-attr]
        return self.max_batch if held < rows else size

    @staticmethod
    def _most_rows(job: GenerationJob, budget: int) -> int:
        """The KV rows `job` may come to hold: its prompt and `max_tokens`, at most `budget`."""
        return min(len(job.request.prompt_ids) + job.request.max_tokens, budget)

    def _waits(self, job: GenerationJob) -> bool:
        """Whether `job` must wait for active requests to end: with the engine's budget of KV rows, their most and
        its own do not fit it (called under the lock). A request alone holds at most the budget (the context)."""
        budget = self.engine.kv_budget_tokens
        return budget is not None and bool(self._active) and \
            sum(self._most_rows(j, budget) for j in [*self._active, job]) > budget

    def _held_rows(self) -> int | None:
        """The KV rows the Sessions may come to hold: the active requests' most and the idle Sessions' rows (a prompt's
        span is lengthened by the room they leave: `GlmMoeDsaModel.prompt_chunk`); None without a budget."""
        budget = self.engine.kv_budget_tokens
        if budget is None:
            return None
        with self._cv:
            return sum(self._most_rows(j, budget) for j in self._active) + sum(s.kv.length for s in self._idle)

    def _hold_pass_rows(self) -> None:
        """Tell the model the KV rows to hold now (`GlmMoeDsaModel.hold_kv_rows`: a cache lending their room gives it
        back first): each request in its prefill its most (before its Session is prepared, also the rows the Session
        has, beside which a restore builds its own), each decoding one its rows and KV_HOLD_AHEAD more (at most its
        most), the idle Sessions their rows. Nothing without a budget. Every pass, before its steps."""
        budget = self.engine.kv_budget_tokens
        if budget is None:
            return
        with self._cv:
            held = sum(s.kv.length for s in self._idle)
            for job in self._active:
                most = self._most_rows(job, budget)
                if job.session is None or job.iterator is None:
                    held += most + (job.session.kv.length if job.session and job.decoder is None else 0)
                else:
                    held += min(most, job.session.kv.length + KV_HOLD_AHEAD)
        self.engine.model.hold_kv_rows(held)

    def _make_room(self, job: GenerationJob, own: Session | None) -> None:
        """Idle Sessions other than `own` (the one that will serve `job`: its rows become the job's) give up their
        rows, least recently used first, until the active requests' most, the rest of the idle rows and `job`'s most
        fit the engine's budget of KV rows (none: nothing to do); called under the lock, once `_waits` said no."""
        budget, held = self.engine.kv_budget_tokens, self._held_rows()
        if budget is None or held is None:
            return
        held += self._most_rows(job, budget) - (own.kv.length if own in self._idle else 0)
        for session in list(self._idle):
            if held <= budget:
                break
            if session is not own and session.kv.length:  # its rows given up: a fresh Session in its place
                held -= session.kv.length
                self._idle.remove(session)
                self._prompt_len.pop(session, None)
                fresh = Session(self.engine.model, self.prefix_cache)
                self._sessions[self._sessions.index(session)] = fresh
                self._idle.insert(0, fresh)

    def _acquire(self, own: Session | None) -> Session:
        """The Session for a new request (called under the lock): `own` (`_reusable`'s) taken from the idle ones, else
        a new one in the pool. The prefix cache restores what the chosen Session lacks."""
        if not self.reuse:
            return Session(self.engine.model, None)
        if own is None:
            own = Session(self.engine.model, self.prefix_cache)
            self._sessions.append(own)
            return own
        self._idle.remove(own)
        return own

    def _reusable(self, prompt_ids: list[int]) -> Session | None:
        """The idle Session a new request with this prompt gets (called under the lock), None for a new one:

        1. The idle Session whose last prompt is a prefix of this one: the same conversation, one turn
           on (its reply may have been re-rendered differently, so only its prompt has to match).
        2. Else None (a new Session) while the pool has room, so other conversations keep their KV rows.
        3. Else the idle Session sharing the longest prefix (the least recently used one on ties).
        """
        if not self.reuse:
            return None
        shared = [(common_prefix(session.ids, prompt_ids), session) for session in self._idle]
        same = [(n, s) for n, s in shared if 0 < self._prompt_len.get(s, -1) <= n]
        if same:
            return max(same, key=lambda item: item[0])[1]
        if len(self._sessions) < self.max_active or not shared:
            return None
        return max(shared, key=lambda item: item[0])[1]  # max() keeps the first (least recent) on ties

    def _release(self, job: GenerationJob, broken: bool) -> None:
        session, job.session = job.session, None
        if session is None or not self.reuse:
            return
        with self._cv:
            self._prompt_len.pop(session, None)
            if broken:  # its KV rows may be half-written: start it over
                index = self._sessions.index(session)
                session = self._sessions[index] = Session(self.engine.model, self.prefix_cache)
            elif job.decoder is not None:  # prepared and committed: it now holds this prompt
                self._prompt_len[session] = len(job.request.prompt_ids)
            self._idle.append(session)

    def _step(self, job: GenerationJob) -> None:
        if job.cancelled:
            self._finish(job, "cancelled")
            return
        self.counters["steps"] += 1
        try:
            if job.batched:
                self._leave_batch(job)
            if job.iterator is None:
                self._prefill_step(job)
            else:
                self._decode_step(job)
        except Exception as e:  # a bug or an I/O error: fail this request, keep serving
            self._fail(job, e)

    def _prefill_step(self, job: GenerationJob) -> None:
        """The first step restores the cached prefix; later ones prefill one chunk each until at most
        `prefill_chunk` tokens are left, which the Generator's own prefill takes (with the first token)."""
        ids, session = job.request.prompt_ids, job.session
        assert session is not None
        model = self.engine.model
        if job.decoder is None:
            start = time.perf_counter()
            kv = session.prepare(ids)
            job.restore_s = time.perf_counter() - start
            # the last prompt token is always computed (its logits pick the first new token)
            job.cached, job.reuse = min(kv.length, len(ids) - 1), session.last_reuse
            job.decoder = StreamDecoder(self.engine.tokenizer)
        kv = session.kv
        start, chunk = kv.length, model.prompt_chunk(self.prefill_chunk, self._held_rows())
        if len(ids) - start > chunk:
            prefill_part(model, ids, start + chunk, kv, self.use_mtp)
            session.store_progress(ids)  # a server stopped during a long prefill resumes it from here
            return
        request = job.request
        eos = () if request.ignore_eos else self.engine.eos_token_ids
        job.generator = Generator(model, eos, use_mtp=self.use_mtp, holds_kv=False)  # held for all above
        job.sampler = Sampler(request.params, request.constraint, request.logprobs)
        job.iterator = job.generator.generate(ids, request.max_tokens, job.sampler, kv)
        self._decode_step(job)

    def _decode_step(self, job: GenerationJob) -> None:
        assert job.generator is not None and job.decoder is not None
        try:
            token = next(job.iterator)
        except StopIteration:
            self._finish(job, "length")  # max_tokens or the model's context
            return
        self._take(job, token)

    def _batch_step(self, jobs: list[GenerationJob], pipelined: bool = False) -> None:
        """One decode step of each of `jobs` (all past their first token) in one batched forward; `pipelined`: where
        the device may choose their tokens (`_pipelined_tokens`), with the batch's next forward queued ahead."""
        rows = []
        for job in jobs:
            if job.cancelled:
                self._finish(job, "cancelled")
                continue
            try:
                if not job.batched:
                    self._join_batch(job)
            except Exception as e:
                self._fail(job, e)
                continue
            assert job.session is not None
            if job.session.kv.length + 1 >= self.engine.model.config.max_position_embeddings:
                self._finish(job, "length")  # the model's context is full (as the Generator stops)
                continue
            rows.append(job)
        if not rows:
            return
        self.counters["steps"] += len(rows)
        self.counters["batched_forwards"] += 1
        self.counters["batched_rows"] += len(rows)
        self.counters["max_batch_seen"] = max(self.counters["max_batch_seen"], len(rows))
        try:
            tokens = self._pipelined_tokens(rows) if pipelined else None
            if tokens is None:
                self._close_pipe()
                logits, _ = self.engine.model.decode_batch(np.array([job.tokens[-1] for job in rows]),
                                                           [job.session.kv for job in rows])  # type: ignore[union-attr]
        except DeviceMemoryError as e:  # the rows rolled back: the next passes decode them in smaller batches
            self._close_pipe()
            held = sum(job.session.kv.capacity for job in rows)  # type: ignore[union-attr]
            size = max(1, len(rows) // 2)
            self._unfit = (min(size, self._unfit[0]), min(held, self._unfit[1])) if self._unfit else (size, held)
            self.counters["batch_shrunk"] += 1
            log.warning("a batch of %d requests with room for %d KV rows does not fit the device (%s): batches of at "
                        "most %d while the requests hold as much", len(rows), held, e, self._unfit[0])
            return
        except Exception as e:  # every row's cache may be half-written
            self._close_pipe()
            log.exception("a batched decode step of %d requests failed", len(rows))
            for job in rows:
                self._finish(job, "error", error=f"{type(e).__name__}: {e}")
            return
        for r, job in enumerate(rows):
            try:
                assert job.sampler is not None
                self._take(job, tokens[r] if tokens is not None else job.sampler(logits[r]))
            except Exception as e:
                self._fail(job, e)

    def _pipelined_tokens(self, rows: list[GenerationJob]) -> list[int] | None:
        """Each row's next token from the batch's pipeline (`GlmMoeDsaModel.pipelined_batch`: the device chooses each
        row's token as its sampler would, from its seeded stream): kept from the last pass where it still holds exactly
        these requests, else started for them where no sampler needs the logits on the host (a grammar, logprobs,
        penalties or biases). None where the batch does not pipeline (the caller then runs `decode_batch`)."""
        if self._pipe is not None and (self._pipe_jobs != rows or not self._pipe.running):
            self._close_pipe()
        if self._pipe is None:
            samplers = [job.sampler for job in rows]
            if not all(s is not None and s.constraint is None and not s.host_only for s in samplers):
                return None
            self._pipe = self.engine.model.pipelined_batch(
                [job.tokens[-1] for job in rows], [job.session.kv for job in rows],  # type: ignore[union-attr]
                [None if s.greedy else s for s in samplers])  # type: ignore[union-attr]
            if self._pipe is None:
                return None
            self._pipe_jobs = list(rows)
        self.counters["pipelined_forwards"] += 1
        return self._pipe.advance()

    def _close_pipe(self) -> None:
        """Stop the batch's pipeline (its forward in flight finishes, its rows dropped): each of its requests' caches
        then lacks its last token's row again, as between batched forwards."""
        if self._pipe is not None:
            pipe, self._pipe, self._pipe_jobs = self._pipe, None, []
            pipe.close()

    def _fail(self, job: GenerationJob, e: Exception) -> None:
        """Log `job`'s error `e` and end it with it."""
        log.exception("request %s failed", job.request.request_id)
        self._finish(job, "error", error=f"{type(e).__name__}: {e}")

    def _join_batch(self, job: GenerationJob) -> None:
        """Move a decoding request from its generator to the batch: the generator closes (a forward it queued
        ahead is dropped) and the cache keeps exactly the prompt and the tokens before the last one."""
        assert job.session is not None
        job.iterator.close()
        job.iterator, job.batched = None, True
        kv = job.session.kv
        kv.truncate(len(job.request.prompt_ids) + len(job.tokens) - 1)  # an accepted MTP draft's row past it
        if kv.length != len(job.request.prompt_ids) + len(job.tokens) - 1:
            raise RuntimeError(f"request {job.request.request_id}: its cache holds {kv.length} rows, "
                               f"not those of {len(job.request.prompt_ids)} prompt and {len(job.tokens) - 1} tokens")

    def _leave_batch(self, job: GenerationJob) -> None:
        """A batched request decoding alone again: a new generator over the prompt and its tokens so far, whose first
        step is the last token's forward (the device decode step and its pipelining where there is one)."""
        assert job.generator is not None and job.session is not None and job.sampler is not None
        if job in self._pipe_jobs:
            self._close_pipe()
        job.batched = False
        job.iterator = job.generator.generate(job.request.prompt_ids + job.tokens,
                                              job.request.max_tokens - len(job.tokens), job.sampler, job.session.kv)

    def _take(self, job: GenerationJob, token: int) -> None:
        """Record a decoded token of `job`: emit its text, finish at eos, a stop sequence or max_tokens."""
        assert job.generator is not None and job.decoder is not None
        if not job.tokens:
            job.first_token = time.perf_counter()
        job.tokens.append(token)
        if token in job.generator.eos:
            self._finish(job, "stop")
            return
        if self._push_text(job, job.decoder.push(token)):
            self._finish(job, "stop", flush=False)
        elif len(job.tokens) >= job.request.max_tokens:
            self._finish(job, "length")

    def _push_text(self, job: GenerationJob, piece: str) -> bool:
        """Add generated text and emit what is safe to show; True when a stop sequence was reached."""
        if not piece:
            return False
        job.text += piece
        stops = job.request.stop
        found = [(at, s) for s in stops if (at := job.text.find(s, job.sent)) >= 0]
        if found:
            hit, job.stop_hit = min(found)
            self._emit_upto(job, hit)
            return True
        hold = max((k for s in stops for k in range(1, len(s)) if job.text.endswith(s[:k])), default=0)
        self._emit_upto(job, len(job.text) - hold)
        return False

    def _emit_upto(self, job: GenerationJob, end: int, everything: bool = False) -> None:
        """Send the text up to `end` (with the logprobs of the tokens since the last Text); `everything`: send the
        logprobs left even without text."""
        chosen = job.sampler.chosen if job.sampler is not None else []
        if end > job.sent or (everything and len(chosen) > job.logprobs_sent):
            text, job.sent = job.text[job.sent:end], max(end, job.sent)
            logprobs, job.logprobs_sent = chosen[job.logprobs_sent:], len(chosen)
            self._send(job, Text(text, logprobs))

    def _send(self, job: GenerationJob, event: Text | Done) -> None:
        try:
            job.emit(event)
        except Exception:  # the receiving side is gone (event loop closed): nobody is listening
            job.cancelled = True

    def _finish(self, job: GenerationJob, reason: str, flush: bool = True, error: str = "") -> None:
        if job in self._pipe_jobs:  # its forward in flight writes its cache: finished and dropped first
            self._close_pipe()
        if reason in ("stop", "length") and flush and job.decoder is not None:
            if self._push_text(job, job.decoder.flush()):
                reason = "stop"
            self._emit_upto(job, len(job.text))  # held-back text that never became a stop sequence
        self._emit_upto(job, job.sent, everything=True)  # logprobs of tokens whose text was held back or cut
        if job.iterator is not None:
            job.iterator.close()
        broken = reason == "error"
        if job.session is not None and job.decoder is not None and not broken:  # prepared: its KV is this prompt's
            try:
                job.session.commit(job.request.prompt_ids, job.tokens)
            except Exception:
                log.exception("request %s: storing its prefill failed", job.request.request_id)
                broken = True
        self._release(job, broken)
        now = time.perf_counter()
        started = job.started or now
        done = Done(reason, len(job.request.prompt_ids), job.cached, len(job.tokens), job.reuse.to_json(),
                    queue_s=started - job.submitted,
                    ttft_s=job.first_token - job.submitted if job.first_token else None,
                    prefill_s=job.first_token - started if job.first_token else None,
                    decode_s=now - job.first_token if job.first_token else 0.0, restore_s=job.restore_s,
                    error=error, stop_sequence=job.stop_hit if reason == "stop" else None)
        with self._cv:
            if job in self._active:
                self._active.remove(job)
            c = self.counters
            c[{"cancelled": "cancelled", "error": "failed"}.get(reason, "completed")] += 1
            c["prompt_tokens"] += done.prompt_tokens
            c["cached_tokens"] += done.cached_tokens
            if job.decoder is not None:
                c["prefill_tokens"] += done.prompt_tokens - done.cached_tokens
            c["completion_tokens"] += done.completion_tokens
            self.recent.append(done.record(job.request.request_id))
        log.info("%s: %s, prompt %d tokens (%d cached), %d generated%s", job.request.request_id, reason,
                 done.prompt_tokens, done.cached_tokens, done.completion_tokens,
                 f", ttft {done.ttft_s:.3f}s" if done.ttft_s is not None else "")
        self._send(job, done)
