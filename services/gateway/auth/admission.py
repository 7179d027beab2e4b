"""Admission control (pure): a bounded number of sequences in flight; beyond it, 429 at once, so
memory never grows with the queue of waiting clients.

A request costs what it asks the engines to run: one completions call with 500 prompts and
n=2 is 1,000 sequences, not one slot (issue 15), so batching cannot walk around the limit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from shoal.shared.errors import InvalidRequest, Overloaded


class Admission:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.num_active = 0
        """Sequences in flight (what the limit counts)."""
        self.num_requests = 0
        """HTTP requests in flight."""

    @contextlib.contextmanager
    def slot(self, cost: int = 1, param: str | None = None) -> Iterator[None]:
        """Hold `cost` sequences for the request's lifetime. A request larger than the whole
        limit could never be admitted, so it is a 400 naming `param`, not a 429 to retry."""
        if cost > self.limit > 0:
            raise InvalidRequest(f"this request runs {cost} sequences; this gateway holds at "
                                 f"most {self.limit} at once (SHOAL_GATEWAY_MAX_OUTSTANDING)",
                                 param=param, code="request_too_large")
        if self.num_active + cost > self.limit:
            raise Overloaded(f"the gateway is at its limit of {self.limit} sequences in flight; "
                             "retry later", code="too_many_requests")
        self.num_active += cost
        self.num_requests += 1
        try:
            yield
        finally:
            self.num_active -= cost
            self.num_requests -= 1
