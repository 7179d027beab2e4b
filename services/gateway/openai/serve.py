"""Drive one OpenAI request's engine streams into its answer: a JSON object, or SSE chunks ending
in `data: [DONE]` (an error after the stream started becomes an error event, never a hang).

Errors before the first reply (unknown model, no instance, prompt too long) still leave as a plain
HTTP error with its status, because the response is only prepared once an engine accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from shoal.services.gateway.metrics import RequestObserver
from shoal.services.gateway.openai.builders import CompletionResponseBuilder
from shoal.services.gateway.openai.objects import ChatChunkChoice, CompletionChoice
from shoal.services.gateway.openai.responses import ChoiceState, ResponseBuilder, add_usage
from shoal.services.gateway.openai.streaming import DONE, SSE_HEADERS, sse_error, sse_event
from shoal.services.gateway.openai.structured import rename_param
from shoal.services.gateway.routing.infer_client import InferClient
from shoal.shared.errors import InvalidRequest, ShoalError
from shoal.shared.schemas.infer import GenerateRequest, InferChunk, InferEnd, Usage

Reply = InferChunk | InferEnd
Entry = ChatChunkChoice | CompletionChoice


@dataclass(slots=True)
class Job:
    """One generate request of an OpenAI request (batched completions have several)."""

    request: GenerateRequest
    hashes: Sequence[bytes]
    index_offset: int = 0
    echo: str = ""


async def merged(client: InferClient, jobs: Sequence[Job]) -> AsyncIterator[tuple[int, Reply]]:
    """(job index, reply) from every job's stream; the first failure ends them all."""
    if len(jobs) == 1:
        async with contextlib.aclosing(client.generate(jobs[0].request, jobs[0].hashes)) as gen:
            async for reply in gen:
                yield 0, reply
        return
    queue: asyncio.Queue[tuple[int, Reply | BaseException]] = asyncio.Queue()

    async def pump(i: int, job: Job) -> None:
        try:
            async with contextlib.aclosing(client.generate(job.request, job.hashes)) as gen:
                async for reply in gen:
                    queue.put_nowait((i, reply))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    remaining = len(jobs)
    try:
        while remaining:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, InferEnd):
                remaining -= 1
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Answer:
    """Runs the jobs for one OpenAI request and writes its answer."""

    def __init__(self, client: InferClient, builder: ResponseBuilder[Any], jobs: Sequence[Job],
                 n: int, observer: RequestObserver, include_usage: bool = False,
                 continuous_usage: bool = False) -> None:
        self.client = client
        self.builder = builder
        self.jobs = jobs
        self.n = n
        self.observer = observer
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.prompt_tokens: dict[int, int] = {}  # job index -> its prompt's length (seq 0)
        self.failed = False
        """The stream ended with an error event (cut_record_id)."""
        self.spec_source: str | None = None
        """The request field its output constraint came from: an engine 400 about the
        constraint names it, in a streamed error event too (structured.rename_param)."""

    def cut_record_id(self, failed: bool) -> str | None:
        """For a one-job answer cut short, the record id its engine would record under: an
        engine records a stream whose inbox vanished before an abort came (this gateway's bus
        connection dropped, say), so the gateway's record goes under the same id, once."""
        tag = self.jobs[0].request.usage
        if (failed or self.failed) and len(self.jobs) == 1 and tag is not None:
            return tag.record_id
        return None

    def usage_so_far(self) -> Usage:
        """Prompt tokens of the jobs accepted so far and every token streamed until now."""
        return Usage(prompt_tokens=sum(self.prompt_tokens.values()),
                     completion_tokens=sum(c.num_tokens for c in self.builder.choices.values()))

    def _chunk(self, entries: list[Entry]) -> bytes:
        usage = self.usage_so_far() if self.continuous_usage else None
        return sse_event(self.builder.chunk(entries, usage, with_usage=self.include_usage))

    def _entries(self, i: int, reply: Reply) -> list[Entry]:
        job = self.jobs[i]
        builder = self.builder
        entries: list[Entry] = []
        if isinstance(reply, InferChunk):
            self.observer.on_chunk(reply)
            if reply.prompt_token_ids is not None:
                self.prompt_tokens[i] = len(reply.prompt_token_ids)
            if reply.tool_call_parser is not None:  # seq 0 of an "auto" tool choice request
                builder.learn_parser(reply.tool_call_parser)
            if reply.reasoning_parser is not None:  # seq 0 of a chat request
                builder.learn_reasoning_parser(reply.reasoning_parser)
            for delta in reply.choices:
                entry = builder.apply(delta, job.index_offset + delta.index)
                if builder.worth_sending(entry):
                    entries.append(builder.with_role(entry))
        else:
            self.observer.on_end(reply)
            builder.usage = add_usage(builder.usage, reply.usage)
            for index in range(self.n):
                reason = reply.finish_reasons.get(index, "stop")
                closing = builder.finish(job.index_offset + index, reason)
                if closing is not None:
                    entries.append(builder.with_role(closing))
        return entries

    async def entries(self) -> AsyncIterator[list[Entry]]:
        """Each engine reply's entries, for answers in another API's shape (Anthropic's
        Messages, OpenAI's Responses), which translate chat entries into their own events."""
        async with contextlib.aclosing(merged(self.client, self.jobs)) as replies:
            async for i, reply in replies:
                yield self._entries(i, reply)

    async def whole(self) -> web.Response:
        return web.json_response((await self.result()).body())

    async def result(self) -> Any:
        """The non-streamed answer's object (ChatCompletion or Completion)."""
        async with contextlib.aclosing(merged(self.client, self.jobs)) as replies:
            async for i, reply in replies:
                self._entries(i, reply)
        prefix = {job.index_offset + k: job.echo for job in self.jobs for k in range(self.n)
                  if job.echo}
        for job in self.jobs:  # choices that produced nothing still appear
            for k in range(self.n):
                self.builder.choices.setdefault(job.index_offset + k, ChoiceState())
        return self.builder.final(prefix)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        async with contextlib.aclosing(merged(self.client, self.jobs)) as replies:
            first = await anext(replies)  # raises before the response is prepared
            response = web.StreamResponse(headers=SSE_HEADERS)
            await response.prepare(request)
            await self._write_echo(response)
            try:
                await self._write(response, *first)
                async for i, reply in replies:
                    await self._write(response, i, reply)
                if self.include_usage:
                    await response.write(sse_event(self.builder.chunk([], self.builder.usage,
                                                                      True)))
            except ShoalError as exc:
                self.failed = True
                if isinstance(exc, InvalidRequest):
                    exc = rename_param(exc, self.spec_source)
                await response.write(sse_error(exc))
            await response.write(DONE)
            await response.write_eof()
            return response

    async def _write_echo(self, response: web.StreamResponse) -> None:
        """Completions with `echo`: the prompt comes first. (A chat choice's role rides with its
        first token: ResponseBuilder.with_role.)"""
        for job in self.jobs:
            if not job.echo:
                continue
            for k in range(self.n):
                await response.write(self._chunk([
                    CompletionResponseBuilder.echo(job.index_offset + k, job.echo)]))

    async def _write(self, response: web.StreamResponse, i: int, reply: Reply) -> None:
        for entry in self._entries(i, reply):
            await response.write(self._chunk([entry]))

