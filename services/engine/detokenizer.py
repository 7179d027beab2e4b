"""IncrementalDetokenizer: turns one sequence's new token ids into new text as they arrive,
never emitting half a UTF-8 character, and finds stop strings across token boundaries while
holding back any text that could still become one (so a stream never shows part of a stop).
"""

from __future__ import annotations

from typing import Any, Protocol

from shoal.services.engine.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
_PREFIX_WINDOW = 5
"""Tokens of left context decoded with each new token (vLLM's prefix_offset): enough for
tokenizers whose decode of a lone token drops or adds a leading space."""


class Tokenizer(Protocol):
    def decode(self, token_ids: Any, skip_special_tokens: bool = ...,
               clean_up_tokenization_spaces: bool | None = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.token_ids: list[int] = list(prompt_token_ids[-_PREFIX_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
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
            self.token_ids.append(token_id)
            self.text += self._decode_next()
        return self._find_stop(old_len) if check_stop else None

    def finish(self) -> None:
        """No more tokens: release the held-back text, incomplete characters included."""
        if not self.is_finished:
            tail = self.token_ids[self.prefix_offset:]
            done = self._decode(tail[:self.read_offset - self.prefix_offset])
            rest = self._decode(tail)
            if len(rest) > len(done):
                self.text += rest[len(done):]
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

    def _decode(self, token_ids: list[int]) -> str:
        # No clean-up pass: it rewrites spaces around punctuation differently depending on the
        # window, which would break the prefix arithmetic (vLLM does not clean up either).
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _decode_next(self) -> str:
        """vLLM's prefix/read offsets: decode with a little left context and keep the part
        after it, unless it ends in U+FFFD (an incomplete byte sequence): wait for more."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text):]

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
