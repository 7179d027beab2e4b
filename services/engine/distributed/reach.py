"""Can a rank reach rank 0's rendezvous? Asked before it joins, so that a rank on a worker cut
off from the lead worker (a partition, a wrong SHOAL_DISTRIBUTED_HOST, a name that does not
resolve) fails in seconds with the address in its error, instead of at the TCPStore's 300 s
rendezvous timeout. A refused connection is not that: the host answers and rank 0 is still
preparing its model files, so the rank waits for it as before.

Torch-free, so unit-tested without starting a process group.
"""

from __future__ import annotations

import socket
import time

CONNECT_TIMEOUT_S = 30.0
"""How long rank 0's host may stay unreachable (no answer, no route, no such name) before a rank
gives up on it."""
ATTEMPT_S = 1.0
RETRY_S = 0.2


class RendezvousUnreachable(RuntimeError):
    """Rank 0's address cannot be reached from this rank's host."""


def wait_for_rank0(host: str, port: int, *, rank: int, unreachable_after: float,
                   give_up_after: float) -> None:
    """Return once rank 0's store accepts a TCP connection. Raise RendezvousUnreachable after
    `unreachable_after` seconds in a row without any answer from its host, or after
    `give_up_after` seconds in all (its host answers, refusing: the store never opened)."""
    start = time.monotonic()
    silent_since: float | None = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=ATTEMPT_S):
                return
        except ConnectionRefusedError as exc:
            silent_since, last = None, exc  # the host is there; its store is not open yet
        except OSError as exc:  # no answer, no route, no such name: a partition or a bad address
            now = time.monotonic()
            silent_since = silent_since if silent_since is not None else now
            last = exc
            if now - silent_since >= unreachable_after:
                raise RendezvousUnreachable(
                    f"rank {rank} cannot reach rank 0's rendezvous at {host}:{port} "
                    f"({type(exc).__name__}: {exc or 'no answer'}; tried for "
                    f"{now - silent_since:.0f} s): is the lead worker's address "
                    "(SHOAL_DISTRIBUTED_HOST) reachable from this worker?") from None
        if time.monotonic() - start >= give_up_after:
            raise RendezvousUnreachable(
                f"rank {rank}: rank 0's rendezvous at {host}:{port} did not open within "
                f"{give_up_after:.0f} s ({type(last).__name__}: {last})")
        time.sleep(RETRY_S)
