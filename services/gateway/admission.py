"""Admission control (pure): a bounded number of requests in flight; beyond it, 429 at once, so
memory never grows with the queue of waiting clients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from shoal.shared.errors import Overloaded


class Admission:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.num_active = 0

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        if self.num_active >= self.limit:
            raise Overloaded(f"the gateway is at its limit of {self.limit} requests in flight; "
                             "retry later", code="too_many_requests")
        self.num_active += 1
        try:
            yield
        finally:
            self.num_active -= 1
