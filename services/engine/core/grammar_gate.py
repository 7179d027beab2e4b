"""GrammarGate: where requests with structured outputs wait before the scheduler. Their spec is
checked when they are processed (parsed once; the parse is kept for the compile), compiled once
per distinct spec beside the step loop, and they are admitted when their grammar is ready, so a
slow compile (seconds for a schema with long bounded strings) never holds up the running batch.
xgrammar is imported at the first such request only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shoal.services.engine.sampling_params import StructuredOutputsParams
from shoal.services.engine.core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from shoal.services.engine.structured_output.compiler import GrammarCompiler

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Parked:
    grammar: futures.Future[Any]
    seqs: list[Sequence]


class GrammarGate:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = frozenset(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._parked: dict[str, _Parked] = {}
        """Requests whose grammar is compiling, in arrival order."""

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            from shoal.services.engine.structured_output.compiler import (GrammarCompiler,
                                                                          tokenizer_info)

            self._compiler = GrammarCompiler(lambda: tokenizer_info(
                self._tokenizer, self._vocab_size, self._eos_token_ids))
        return self._compiler

    @compiler.setter
    def compiler(self, compiler: GrammarCompiler) -> None:
        self._compiler = compiler  # tests: a compiler over a toy vocabulary

    def __bool__(self) -> bool:
        return bool(self._parked)

    @property
    def num_seqs(self) -> int:
        return sum(len(parked.seqs) for parked in self._parked.values())

    def check(self, spec: StructuredOutputsParams) -> None:
        """InvalidRequest (400) for a schema, regex or grammar that does not parse (~1 ms; the
        parse is kept for the compile)."""
        self.compiler.parse(spec)

    def park(self, request_id: str, spec: StructuredOutputsParams, seqs: list[Sequence]) -> None:
        self._parked[request_id] = _Parked(self.compiler.compile(spec), seqs)

    def discard(self, request_id: str) -> bool:
        """Forget a parked request (aborted): its sequences end as aborted."""
        parked = self._parked.pop(request_id, None)
        for seq in parked.seqs if parked is not None else []:
            seq.status = SequenceStatus.FINISHED_ABORTED
        return parked is not None

    def take_ready(self, wait_s: float = 0.0) -> tuple[list[list[Sequence]], list[str]]:
        """(the sequences of each request whose grammar is ready, now carrying it in
        SamplingParams.compiled_grammar; the ids of requests whose compile failed, still
        parked). Waits up to wait_s for a compile when none is ready."""
        if wait_s > 0 and self._parked:
            futures.wait([p.grammar for p in self._parked.values()], timeout=wait_s,
                         return_when=futures.FIRST_COMPLETED)
        ready: list[list[Sequence]] = []
        failed: list[str] = []
        for request_id, parked in list(self._parked.items()):
            if not parked.grammar.done():
                continue
            if parked.grammar.exception() is not None:
                log.error("compiling the grammar of request %s failed", request_id,
                          exc_info=parked.grammar.exception())
                failed.append(request_id)
                continue
            del self._parked[request_id]
            params = parked.seqs[0].params.with_compiled_grammar(parked.grammar.result())
            for seq in parked.seqs:
                seq.params = params
            ready.append(parked.seqs)
        return ready, failed
