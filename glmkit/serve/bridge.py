"""The channel between the generation worker thread and a request's asyncio task: submitting a job, and
reading its events back (all at once, or as a stream), cancelling it when the client goes away."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from starlette.requests import Request

from glmkit.serve.config import Loaded, State
from glmkit.serve.protocol import ApiError, Common, generation_failed
from glmkit.serve.scheduler import Done, GenerationJob, GenRequest, QueueFull, Scheduler, Text

DISCONNECT_POLL_S = 0.2  # how often a non-streaming request checks that its client is still there


class Channel:
    """Carries the worker thread's events into this request's event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Text | Done] = asyncio.Queue()

    def emit(self, event: Text | Done) -> None:  # worker thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


def submit(loaded: Loaded, state: State, ids: list[int], common: Common, request_id: str
           ) -> tuple[GenerationJob, Channel]:
    """Queue the prompt `ids` for generation; 429 when the scheduler's queue is full."""
    remaining = loaded.engine.config.max_position_embeddings - len(ids)
    max_tokens = common.max_tokens or min(state.config.default_max_tokens, remaining)
    request = GenRequest(ids, max_tokens, common.params, common.stop, common.ignore_eos, request_id)
    channel = Channel()
    try:
        job = loaded.scheduler.submit(request, channel.emit)
    except QueueFull as e:
        raise ApiError(429, f"the server is busy ({e}); retry later", "server_error", code="server_busy") from None
    return job, channel


class ClientGone(Exception):
    pass


async def collect(request: Request, scheduler: Scheduler, job: GenerationJob, channel: Channel) -> tuple[str, Done]:
    """All of a request's text (non-streaming); cancels the job when the client disconnects (ClientGone)
    and raises the OpenAI-shaped 500 when generation failed."""
    parts: list[str] = []
    checked = time.monotonic()
    try:
        while True:
            try:
                event = await asyncio.wait_for(channel.queue.get(), timeout=DISCONNECT_POLL_S)
            except TimeoutError:
                event = None
            if time.monotonic() - checked >= DISCONNECT_POLL_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    raise ClientGone()
            if event is None:
                continue
            if isinstance(event, Done):
                if event.finish_reason == "error":
                    raise generation_failed(event)
                return "".join(parts), event
            parts.append(event.text)
    finally:
        scheduler.cancel(job)  # a no-op once the job is done


async def events(scheduler: Scheduler, job: GenerationJob, channel: Channel) -> AsyncIterator[Text | Done]:
    """The job's events (streaming). Starlette cancels this when the client disconnects: so is the job."""
    try:
        while True:
            event = await channel.queue.get()
            yield event
            if isinstance(event, Done):
                return
    finally:
        scheduler.cancel(job)
