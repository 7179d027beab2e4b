"""Structured outputs (guided decoding) on xgrammar, the core's half: check a spec when a request
is added and compile it once per distinct spec on a background thread (never on the step loop).
The runner's half, the per-sequence matcher and the token bitmask, is matcher.py.

The engine imports this module only for its first constrained request (core/grammar_gate.py),
so an engine that never sees one never loads xgrammar.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from shoal.services.engine.sampling_params import StructuredOutputsParams
from shoal.services.engine.structured_output.grammar_check import never_ending_rules
from shoal.shared.errors import InvalidRequest

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
