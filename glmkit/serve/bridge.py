"""The channel between the generation worker thread and a request's asyncio task: submitting a job, and
reading its events back (all at once, or as a stream), cancelling it when the client goes away or the
server shuts down."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from starlette.requests import Request

from glmkit.generate.sampling import TokenLogprob
from glmkit.serve.protocol import ApiError, generation_failed, shutting_down
from glmkit.serve.scheduler import Done, GenerationJob, GenRequest, QueueFull, Scheduler, Text

DISCONNECT_POLL_S = 0.2  # how often a non-streaming request checks that its client is still there


class Shutdown:
    """Put into every open channel when the server begins to shut down."""


class Channel:
    """Carries the worker thread's events into this request's event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Text | Done | Shutdown] = asyncio.Queue()

    def emit(self, event: Text | Done | Shutdown) -> None:  # any thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


class Channels:
    """The channels of the requests in flight, so that a shutdown can end each of them with an error."""

    def __init__(self) -> None:
        self.open: set[Channel] = set()
        self.closing = False

    def begin_shutdown(self) -> None:
        """From any thread (a signal handler too): refuse new jobs, end the running ones' requests."""
        self.closing = True
        for channel in list(self.open):
            channel.emit(Shutdown())


def submit_job(scheduler: Scheduler, channels: Channels, request: GenRequest) -> tuple[GenerationJob, Channel]:
    """Queue `request` for generation; 429 when the scheduler's queue is full, 503 once shutting down."""
    if channels.closing:
        raise shutting_down()
    channel = Channel()
    try:
        job = scheduler.submit(request, channel.emit)
    except QueueFull as e:
        raise ApiError(429, f"the server is busy ({e}); retry later", "server_error", code="server_busy") from None
    channels.open.add(channel)
    return job, channel


class ClientGone(Exception):
    pass


async def collect(request: Request, scheduler: Scheduler, channels: Channels, job: GenerationJob, channel: Channel
                  ) -> tuple[str, list[TokenLogprob], Done]:
    """All of a request's text and its tokens' logprobs (when asked for; non-streaming); cancels the job when the
    client disconnects (ClientGone), raises the OpenAI-shaped 500 when generation failed and the 503 when the
    server shuts down."""
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
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
            if isinstance(event, Shutdown):
                raise shutting_down()
            if isinstance(event, Done):
                if event.finish_reason == "error":
                    raise generation_failed(event)
                return "".join(parts), logprobs, event
            parts.append(event.text)
            logprobs += event.logprobs
    finally:
        scheduler.cancel(job)  # a no-op once the job is done
        channels.open.discard(channel)


async def events(scheduler: Scheduler, channels: Channels, job: GenerationJob, channel: Channel
                 ) -> AsyncIterator[Text | Done]:
    """The job's events (streaming), ending with its Done; raises the OpenAI-shaped 500 when generation failed
    and the 503 when the server shuts down. Starlette cancels this when the client disconnects: so is the job."""
    try:
        while True:
            event = await channel.queue.get()
            if isinstance(event, Shutdown):
                raise shutting_down()
            if isinstance(event, Done) and event.finish_reason == "error":
                raise generation_failed(event)
            yield event
            if isinstance(event, Done):
                return
    finally:
        scheduler.cancel(job)
        channels.open.discard(channel)
