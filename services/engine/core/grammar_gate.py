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

from shoal.services.engine.core.sequence import Sequence
from shoal.services.engine.sampling_params import SamplingParams, StructuredOutputsParams

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

    def discard(self, request_id: str) -> list[Sequence]:
        """Forget a parked request (aborted); returns its sequences, for the scheduler to end."""
        parked = self._parked.pop(request_id, None)
        return parked.seqs if parked is not None else []

    def take_ready(self, wait_s: float = 0.0
                   ) -> tuple[list[tuple[list[Sequence], SamplingParams]], list[str]]:
        """(for each request whose grammar is ready, its sequences and their params carrying it
        in SamplingParams.compiled_grammar (the scheduler sets them when it adds them); the ids
        of requests whose compile failed, still parked). Waits up to wait_s for a compile when
        none is ready."""
        if wait_s > 0 and self._parked:
            futures.wait([p.grammar for p in self._parked.values()], timeout=wait_s,
                         return_when=futures.FIRST_COMPLETED)
        ready: list[tuple[list[Sequence], SamplingParams]] = []
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
            ready.append((parked.seqs, parked.seqs[0].params.with_compiled_grammar(
                parked.grammar.result())))
        return ready, failed
