"""IncrementalDetokenizer: turns one sequence's new token ids into new text as they arrive,
never emitting half a UTF-8 character, and finds stop strings across token boundaries while
holding back any text that could still become one (so a stream never shows part of a stop).

Decoding is `tokenizers`' DecodeStream (the Rust decoder, as vLLM's fast detokenizer uses it):
it keeps the left context and buffers incomplete byte sequences itself, at ~0.5 us a token
against ~25 us for re-decoding a window of tokens in Python (docs/figures.md).
"""

from __future__ import annotations

from typing import Any, Protocol

from tokenizers.decoders import DecodeStream

from shoal.services.engine.sampling_params import SamplingParams

_PREFIX_WINDOW = 5
"""Prompt tokens fed to the stream first, as left context: a token's leading space (or its
absence) depends on what precedes it."""


class Tokenizer(Protocol):
    """A transformers fast tokenizer (its `backend_tokenizer` is the `tokenizers.Tokenizer`
    that DecodeStream runs)."""

    def decode(self, token_ids: Any, skip_special_tokens: bool = ...,
               clean_up_tokenization_spaces: bool | None = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.stream = self._new_stream()
        for token_id in prompt_token_ids[-_PREFIX_WINDOW:]:
            self._step(token_id)  # context only: its text is the prompt's
        self.pending: list[int] = []
        """Tokens fed since the stream last released text (an incomplete character)."""
        self.text = ""
        """All the text decoded so far (cut at a stop string once one is found)."""
        self.num_released = 0
        """Characters of text already handed out by take_delta()."""
        self.is_finished = False

    def update(self, new_token_ids: list[int], check_stop: bool = True) -> str | None:
        """Decode new tokens; returns the stop string that ends the text, if one now does
        (check_stop=False while min_tokens are not reached yet)."""
        if self.is_finished:
            return None
        old_len = len(self.text)
        for token_id in new_token_ids:
            chunk = self._step(token_id)
            if chunk is None:
                self.pending.append(token_id)
            else:
                self.text += chunk
                self.pending.clear()
        return self._find_stop(old_len) if check_stop else None

    def finish(self) -> None:
        """No more tokens: release the held-back text, incomplete characters included."""
        if not self.is_finished:
            if self.pending:
                self.text += self.tokenizer.decode(self.pending,
                                                   skip_special_tokens=self.skip_special_tokens,
                                                   clean_up_tokenization_spaces=False)
                self.pending.clear()
            self.is_finished = True

    @property
    def releasable_text(self) -> str:
        """The text a user may see now: without a suffix that could begin a stop string."""
        if self.is_finished or not self.stop:
            return self.text
        return self.text[:len(self.text) - self._held_back()]

    def take_delta(self) -> str:
        """Text released since the previous call."""
        text = self.releasable_text
        delta = text[self.num_released:]
        self.num_released = len(text)
        return delta

    def _step(self, token_id: int) -> str | None:
        """The stream's next text, or None while a character is incomplete. A stream that
        refuses a token (an invalid prefix after a skipped special token) starts afresh with
        it, as vLLM's fast detokenizer does."""
        try:
            return self.stream.step(self.backend, token_id)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a plain Exception
            if "Invalid prefix" not in str(exc):
                raise
            self.stream = self._new_stream()
            return self.stream.step(self.backend, token_id)

    def _new_stream(self) -> Any:
        if self.backend is None:  # a tokenizer without a Rust backend (test doubles)
            return _TokenByToken(self.tokenizer, self.skip_special_tokens)
        return DecodeStream(skip_special_tokens=self.skip_special_tokens)

    def _find_stop(self, old_len: int) -> str | None:
        """The earliest stop string ending in the new text; the text is cut at it."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            idx = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[:idx + len(stop) if self.include_stop else idx]
        self.is_finished = True
        return stop

    def _held_back(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest


class _TokenByToken:
    """DecodeStream's interface for tokenizers whose every token decodes on its own."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens

    def step(self, _backend: Any, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=self.skip_special_tokens)
