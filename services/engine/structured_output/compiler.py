"""Structured outputs (guided decoding) on xgrammar: check a spec when a request is added, compile
it once per distinct spec on a background thread (never on the step loop), and per sequence a
matcher that fills the token bitmask each step and follows the tokens the sequence sampled.

The engine imports this module only for its first constrained request, so an engine that never
sees one never loads xgrammar.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from shoal.services.engine.structured_output.grammar_check import never_ending_rules
from shoal.services.engine.sampling_params import StructuredOutputsParams
from shoal.shared.errors import InvalidRequest

log = logging.getLogger(__name__)
MAX_CACHED_GRAMMARS = 256
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[12:00:00] file.cc:83: "


def to_grammar(spec: StructuredOutputsParams) -> xgr.Grammar:
    """The spec as an xgrammar Grammar (parsing only: fast, needs no tokenizer).

    A bad schema, regex or grammar is InvalidRequest naming structured_outputs.<kind>, and so is
    one that matches no finite text (xgrammar accepts `root ::= root`; its matcher then allows no
    token, and sampling from nothing gave garbage)."""
    kind = spec.kind
    whitespace = not spec.disable_any_whitespace
    try:
        if kind == "json":
            grammar = xgr.Grammar.from_json_schema(spec.json_text, any_whitespace=whitespace)
        elif kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=whitespace)
        elif kind == "regex":
            return xgr.Grammar.from_regex(spec.regex or "")
        elif kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(spec.choice or []))
        else:
            grammar = xgr.Grammar.from_ebnf(spec.grammar or "")
    except (RuntimeError, ValueError, TypeError) as exc:
        message = _XGRAMMAR_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc) else "")
        raise InvalidRequest(f"invalid structured_outputs.{kind}: {message or type(exc).__name__}",
                             param=f"structured_outputs.{kind}") from None
    check_ends(grammar, kind)
    return grammar


def check_ends(grammar: xgr.Grammar, kind: str) -> None:
    """InvalidRequest when no finite text matches the grammar (grammar_check)."""
    dead = never_ending_rules(grammar)
    if not dead:
        return
    if kind == "json":
        why = ("no finite JSON value matches the schema: it refers back to itself ($ref) with "
               "no way out; make the recursive property optional, or allow an alternative such "
               "as null")
    else:
        why = (f"no finite text matches the grammar: rule {dead[0]} never ends (every "
               f"alternative of {', '.join(dead[:8])} refers back to one of them); give the "
               f"recursion an alternative that ends")
    raise InvalidRequest(f"invalid structured_outputs.{kind}: {why}",
                         param=f"structured_outputs.{kind}")


def choice_ebnf(choices: Iterable[str]) -> str:
    """root ::= "a" | "b": JSON string escapes are valid EBNF literal escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def tokenizer_info(tokenizer: Any, vocab_size: int,
                   eos_token_ids: Iterable[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of a Hugging Face tokenizer; the engine's EOS ids end a finished grammar."""
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=sorted(eos_token_ids))


class GrammarCompiler:
    """Parses specs once (`parse`, called by the engine's check of a request) and compiles them
    off the step loop, once per distinct spec: two LRUs keyed by StructuredOutputsParams.key, of
    parsed grammars and of compile futures (so concurrent requests with one schema share one
    compile, and the compile reuses the check's parse).

    `make_info` builds the TokenizerInfo on the compile thread at first use, so an engine that
    never sees a constrained request never pays for it."""

    def __init__(self, make_info: Callable[[], xgr.TokenizerInfo],
                 max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        self._make_info = make_info
        self._compiler: xgr.GrammarCompiler | None = None
        self._max_cached = max_cached
        self._cache: OrderedDict[tuple[str, str, bool], Future[xgr.CompiledGrammar]] = OrderedDict()
        self._parsed: OrderedDict[tuple[str, str, bool], xgr.Grammar] = OrderedDict()
        self._parsed_lock = threading.Lock()  # parse runs on the caller's thread, compile on ours
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-grammar")
        self.num_compiled = 0

    def parse(self, spec: StructuredOutputsParams) -> xgr.Grammar:
        """The spec's grammar, parsed at most once while cached (InvalidRequest if it does not)."""
        key = spec.key
        with self._parsed_lock:
            grammar = self._parsed.get(key)
            if grammar is not None:
                self._parsed.move_to_end(key)
                return grammar
        grammar = to_grammar(spec)
        with self._parsed_lock:
            self._parsed[key] = grammar
            while len(self._parsed) > self._max_cached:
                self._parsed.popitem(last=False)
        return grammar

    def compile(self, spec: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        key = spec.key
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return future
        future = self._executor.submit(self._compile, spec)
        self._cache[key] = future
        while len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)
        return future

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        if self._compiler is None:
            threads = max(1, min(8, (os.cpu_count() or 2) // 2))
            self._compiler = xgr.GrammarCompiler(self._make_info(), max_threads=threads,
                                                 cache_enabled=False)
        compiled = self._compiler.compile_grammar(self.parse(spec))
        self.num_compiled += 1
        return compiled


@dataclass(slots=True)
class GrammarState:
    """One sequence's matcher. It follows the sequence's output tokens lazily (`catch_up`), so a
    preempted and recomputed sequence, whose tokens do not change, needs nothing special."""

    matcher: xgr.GrammarMatcher
    stop_token_ids: list[int]
    num_accepted: int = 0
    is_broken: bool = False
    """A token was refused (cannot happen with the mask applied): only a stop token is allowed."""
    dead_end: bool = False
    """The grammar allowed no token at all (a branch that can never end, or bytes no token
    spells): only a stop token is allowed, and the runner reports the sequence so the engine
    fails its request rather than sample from nothing."""

    @classmethod
    def create(cls, compiled: xgr.CompiledGrammar) -> GrammarState:
        matcher = xgr.GrammarMatcher(compiled)
        return cls(matcher, list(compiled.tokenizer_info.stop_token_ids))

    def catch_up(self, token_ids: list[int], output_start: int = 0) -> None:
        """Accept the output tokens (token_ids[output_start:]) sampled since the last call;
        only the new ones are read, so a long answer costs nothing more per step."""
        for token in itertools.islice(token_ids, output_start + self.num_accepted, None):
            self.num_accepted += 1
            if self.is_broken or self.matcher.is_terminated():
                continue
            if not self.matcher.accept_token(token):
                log.warning("grammar refused token %d after %d tokens; ending the sequence",
                            token, self.num_accepted - 1)
                self.is_broken = True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask [num_rows, ceil(vocab / 32)] int32: row `row` allows the next legal tokens."""
        if not (self.is_broken or self.dead_end or self.matcher.is_terminated()):
            self.matcher.fill_next_token_bitmask(bitmask, row)
            if bool(bitmask[row].any()):
                return
            log.warning("grammar allows no token after %d tokens; failing the request",
                        self.num_accepted)
            self.dead_end = True
        bitmask[row] = 0  # ended: only a stop token (ignore_eos keeps asking)
        for token in self.stop_token_ids:
            bitmask[row, token // 32] |= _bit(token % 32)


def _bit(offset: int) -> int:
    """The int32 value with only bit `offset` set (bit 31 is the sign bit)."""
    return (1 << offset) - (1 << 32 if offset == 31 else 0)


def apply_bitmask(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """logits [num_rows, vocab] (in place): in each listed row, every token its grammar forbids
    gets -inf; other rows are untouched. xgrammar's kernel masks (C++ on CPU, Triton on CUDA);
    the bitmask is filled on the CPU and copied once to the logits' device."""
    num_rows, vocab = logits.shape
    bitmask = xgr.allocate_token_bitmask(num_rows, vocab)  # [num_rows, ceil(vocab / 32)], all -1
    for row, state in zip(rows, states):
        state.fill(bitmask, row)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
