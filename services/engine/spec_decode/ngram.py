"""N-gram prompt lookup (vLLM's method "ngram"): if the last n tokens (n from
prompt_lookup_max down to prompt_lookup_min) occurred before, propose what followed their latest
earlier occurrence. Free to compute, and right whenever the output copies its context (edits,
summaries quoting the text, code rewrites, repetition loops).
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k draft tokens following token_ids (empty when no n-gram matches)."""
        num = len(token_ids)
        if k < 1 or num < self.lookup_min + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # Ends of earlier occurrences of the last token, latest first (the suffix itself excluded).
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])[::-1]
        if ends.size == 0:
            return []
        longest = min(self.lookup_max, num - 1)
        match = np.ones(ends.size, dtype=np.int64)  # matched suffix length per candidate
        alive = np.ones(ends.size, dtype=bool)
        for back in range(1, longest):
            idx = ends - back
            ok = alive & (idx >= 0)
            ok[ok] = tokens[idx[ok]] == tokens[num - 1 - back]
            alive = ok
            if not alive.any():
                break
            match += alive
        best = int(match.max())
        if best < self.lookup_min:
            return []
        end = int(ends[int(np.argmax(match == best))])  # the latest of the longest matches
        return tokens[end + 1:end + 1 + k].tolist()
