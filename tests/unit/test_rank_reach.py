"""A rank that cannot reach rank 0 fails in seconds, naming the address (distributed/reach.py),
not at the 300 s rendezvous timeout; one whose rank 0 is still starting (refused: its host
answers) waits for it. The last test runs a real rank process against an address that does not
resolve."""

from __future__ import annotations

import socket
import subprocess
import threading
import time

import pytest

from shoal.services.engine.distributed.launch import RankLaunch
from shoal.services.engine.distributed.reach import RendezvousUnreachable, wait_for_rank0
from shoal.shared.embedded import free_port


@pytest.mark.parametrize("host", ["rank0.invalid", "192.0.2.1"])  # no such name; TEST-NET-1
def test_an_unreachable_rank0_fails_in_seconds_naming_it(host: str) -> None:
    with pytest.raises(RendezvousUnreachable) as err:
        wait_for_rank0(host, 29500, rank=1, unreachable_after=0.5, give_up_after=300)
    assert f"cannot reach rank 0's rendezvous at {host}:29500" in str(err.value)
    assert "SHOAL_DISTRIBUTED_HOST" in str(err.value)


def test_a_rank0_still_starting_is_waited_for() -> None:
    port = free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def open_later() -> None:
        time.sleep(0.6)  # refused until then: the host answers, its store is not open yet
        server.bind(("127.0.0.1", port))
        server.listen()

    opener = threading.Thread(target=open_later)
    opener.start()
    try:
        wait_for_rank0("127.0.0.1", port, rank=1, unreachable_after=0.1, give_up_after=60)
    finally:
        opener.join()
        server.close()


def test_a_store_that_never_opens_gives_up_at_the_rendezvous_timeout() -> None:
    with pytest.raises(RendezvousUnreachable) as err:
        wait_for_rank0("127.0.0.1", free_port(), rank=2, unreachable_after=0.1,
                       give_up_after=0.3)
    assert "did not open within" in str(err.value) and "rank 2" in str(err.value)


def test_the_connect_timeout_rides_on_the_command_line() -> None:
    launch = RankLaunch(rank=1, init_method="tcp://h:1", config={"model": "m"},
                        connect_timeout=2.5)
    assert RankLaunch.parse(launch.argv()[3:]).connect_timeout == 2.5
    default = RankLaunch(rank=1, init_method="tcp://h:1", config={"model": "m"})
    assert "--connect-timeout" not in default.argv()
    assert RankLaunch.parse(default.argv()[3:]).connect_timeout == default.connect_timeout


def test_a_rank_process_cut_off_from_rank0_exits_naming_the_address(tmp_path) -> None:
    launch = RankLaunch(rank=1, init_method="tcp://rank0.invalid:29511", watch_parent=False,
                        config={"model": str(tmp_path), "device": "cpu",
                                "pipeline_parallel_size": 2}, model_dir=str(tmp_path),
                        connect_timeout=1.0)
    done = subprocess.run(launch.argv(), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "cannot reach rank 0's rendezvous at rank0.invalid:29511" in done.stderr, \
        done.stderr[-2000:]
