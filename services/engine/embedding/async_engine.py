"""AsyncEmbeddingEngine: concurrent requests batched together on one compute thread.

Requests queue up while a batch runs; the thread then takes everything waiting and embeds it in
one call (which groups it by length within the engine's batch limits), so many small requests
share forwards the way generation's continuous batching shares steps. Compute never runs on the
event loop that serves the bus.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shoal.services.engine.config import EngineConfig
from shoal.services.engine.embedding.engine import EmbeddingEngine
from shoal.shared.errors import InvalidRequest


@dataclass(slots=True)
class EmbeddingStats:
    num_running: int = 0
    """Inputs in the batch being computed."""
    num_waiting: int = 0
    """Inputs queued behind it."""
    prompt_tokens: int = 0
    """Cumulative tokens embedded."""
    num_requests: int = 0
    num_batches: int = 0
    """Compute rounds: fewer than requests when concurrent ones were batched together."""


@dataclass(slots=True)
class _Job:
    token_ids: Sequence[Sequence[int]]
    dimensions: int | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[torch.Tensor]
    token_types: Sequence[Sequence[int]] | None = None
    """A cross-encoder's pairs (score, not embed): each sequence's token types."""
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = len(self.token_ids)


class AsyncEmbeddingEngine:
    def __init__(self, config: EngineConfig, model_dir: Path | None = None) -> None:
        self.engine = EmbeddingEngine(config, model_dir)
        self.stats = EmbeddingStats()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._backlog: collections.deque[_Job] = collections.deque()
        """Jobs taken off the queue, waiting for a round (touched by the thread only)."""
        self._thread = threading.Thread(target=self._run, name="shoal-embedding", daemon=True)
        self._thread.start()

    async def embed(self, token_ids: Sequence[Sequence[int]],
                    dimensions: int | None = None) -> torch.Tensor:
        """Checked inputs -> vectors (raises InvalidRequest before queueing a bad one)."""
        if self.engine.score_head is not None:
            raise InvalidRequest(f"model {self.engine.config.model} is a cross-encoder: it "
                                 "serves /v1/score and /v1/rerank, not embeddings",
                                 param="model", code="wrong_model_type")
        self.engine.inputs.check_embedding_inputs(token_ids)
        self.engine.check_dimensions(dimensions)
        loop = asyncio.get_running_loop()
        job = _Job(token_ids, dimensions, loop, loop.create_future())
        with self._lock:
            self.stats.num_waiting += job.size
        self._jobs.put(job)
        return await job.future

    async def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]
                    ) -> torch.Tensor:
        """Checked (token ids, token types) pairs -> a cross-encoder's scores `[len(pairs)]`,
        batched with whatever else is waiting, as embed's inputs are."""
        if self.engine.score_head is None:
            self.engine.score([])  # raises: an embedder has no scores
        ids = [p[0] for p in pairs]
        self.engine.inputs.check_embedding_inputs(ids, param="documents")
        loop = asyncio.get_running_loop()
        job = _Job(ids, None, loop, loop.create_future(), [p[1] for p in pairs])
        with self._lock:
            self.stats.num_waiting += job.size
        self._jobs.put(job)
        return await job.future

    def _run(self) -> None:
        while True:
            self._drain_queue()
            first = self._backlog.popleft() if self._backlog else self._jobs.get()
            if first is None:
                return
            self._drain_queue()
            jobs = [first]
            size = first.size
            # what queued meanwhile joins this round, up to max_num_seqs inputs (the rest waits,
            # and num_waiting shows it: the autoscaler's signal)
            while size < self.engine.config.max_num_seqs and self._backlog:
                nxt = self._backlog[0]
                if size + nxt.size > self.engine.config.max_num_seqs:
                    break
                jobs.append(self._backlog.popleft())
                size += nxt.size
            self._compute(jobs)

    def _drain_queue(self) -> None:
        """Move what was submitted into the backlog, in order (a None stops the thread)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:  # leave it for _run, after the backlog
                self._jobs.put(None)
                return
            self._backlog.append(job)

    def _compute(self, jobs: list[_Job]) -> None:
        size = sum(j.size for j in jobs)
        with self._lock:
            self.stats.num_waiting -= size
            self.stats.num_running = size
        # one forward pass per dimensions value, and one for scores (the usual case: one group)
        by_dims: dict[tuple[bool, int | None], list[_Job]] = {}
        for job in jobs:
            by_dims.setdefault((job.token_types is not None, job.dimensions), []).append(job)
        outcomes: list[tuple[_Job, torch.Tensor | BaseException]] = []
        for (scores, dims), group in by_dims.items():
            flat = [ids for job in group for ids in job.token_ids]
            try:
                if scores:
                    vectors = self.engine.score(list(zip(
                        flat, [t for job in group for t in job.token_types or ()])))
                else:
                    vectors = self.engine.embed(flat, dims)
            except Exception as exc:  # noqa: BLE001 - every waiting request hears of it
                outcomes += [(job, exc) for job in group]
                continue
            start = 0
            for job in group:
                outcomes.append((job, vectors[start:start + job.size]))
                start += job.size
        with self._lock:  # counted before anyone is answered, so an answer sees its own count
            self.stats.num_running = 0
            self.stats.num_requests += len(jobs)
            self.stats.num_batches += 1
            self.stats.prompt_tokens += sum(len(ids) for j in jobs for ids in j.token_ids)
        for job, outcome in outcomes:
            job.loop.call_soon_threadsafe(_fail if isinstance(outcome, BaseException)
                                          else _resolve, job.future, outcome)

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)


def _resolve(future: asyncio.Future[torch.Tensor], value: object) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[torch.Tensor], exc: object) -> None:
    if not future.done():
        future.set_exception(exc)  # type: ignore[arg-type]
