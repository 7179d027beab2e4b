"""A rank other than 0: `python -m shoal.services.engine.distributed.rank_process ...`.

It joins the rendezvous, builds its ModelRunner over its shard, then runs every step the driver
broadcasts until the driver broadcasts None (or goes away: a collective fails, or its parent
process is gone). The same entry point serves the offline executor and the worker agent, so a
rank is a plain process that the supervisor can watch, kill and restart; spawning it by module
path also keeps the user's script from being re-imported (multiprocessing's spawn does that).
Its command line is a RankLaunch (launch.py), which both launchers build.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

from shoal.services.engine.distributed.reach import CONNECT_TIMEOUT_S, wait_for_rank0

RENDEZVOUS_TIMEOUT_S = 300
"""How long a rank waits for the others at the rendezvous (and a collective for its peers)."""

log = logging.getLogger("shoal.engine.rank")


def main(argv: list[str] | None = None) -> int:
    from shoal.services.engine.distributed.launch import RankLaunch

    launch = RankLaunch.parse(argv)
    if launch.cores:
        os.sched_setaffinity(0, set(launch.cores))
    if launch.watch_parent:
        _exit_with_parent()
    logging.basicConfig(level=logging.INFO,
                        format=f"rank {launch.rank} %(levelname)s %(message)s")

    from shoal.services.engine.config import EngineConfig

    config = EngineConfig(**launch.config)
    if launch.model_dir:
        model_dir = Path(launch.model_dir)
    else:
        from shoal.services.engine.model_prep import prepare_model

        model_dir = prepare_model(config.model,
                                  Path(launch.cache_dir) if launch.cache_dir else None)
    serve_rank(config, model_dir, launch.rank, launch.init_method, launch.connect_timeout)
    return 0


def serve_rank(config: object, model_dir: Path, rank: int, init_method: str,
               connect_timeout: float = CONNECT_TIMEOUT_S) -> None:
    import torch.distributed as dist

    from shoal.services.engine.distributed.parallel_state import ParallelContext
    from shoal.services.engine.runner.model_runner import ModelRunner

    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size  # type: ignore[attr-defined]
    if backend_for(config.device) == "nccl":  # type: ignore[attr-defined]
        import torch

        torch.cuda.set_device(config.device)  # type: ignore[attr-defined]
    host, port = parse_init_method(init_method)
    # fail in seconds, naming the address, when rank 0's host cannot be reached at all
    wait_for_rank0(host, port, rank=rank, unreachable_after=connect_timeout,
                   give_up_after=RENDEZVOUS_TIMEOUT_S)
    timeout = timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    store = dist.TCPStore(host, port, tp * pp, is_master=False, timeout=timeout)
    store.set(joined_key(rank), str(os.getpid()))  # rank 0 waits for these (executor.py)
    dist.init_process_group(backend_for(config.device), store=store,  # type: ignore[attr-defined]
                            rank=rank, world_size=tp * pp, timeout=timeout)
    parallel = ParallelContext.create(rank, tp, pp)
    runner = ModelRunner(config, model_dir, parallel)  # type: ignore[arg-type]
    log.info("rank %d ready: tp rank %d, pp rank %d, %d KV blocks", rank, parallel.tp_rank,
             parallel.pp_rank, runner.num_kv_blocks)
    try:
        while True:
            box: list[object] = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:  # the driver's shutdown
                break
            out = runner.execute(box[0])  # type: ignore[arg-type]
            if rank == parallel.output_rank:
                dist.send_object_list([out], dst=0)
    finally:
        dist.destroy_process_group()


def joined_key(rank: int) -> str:
    """The store key a rank sets before it joins the process group: rank 0 polls for them, so a
    rank that dies first is named at once rather than at the store's timeout."""
    return f"shoal/joined/{rank}"


def parse_init_method(init_method: str) -> tuple[str, int]:
    """tcp://host:port -> (host, port)."""
    parsed = urlsplit(init_method)
    if parsed.scheme != "tcp" or not parsed.hostname or not parsed.port:
        raise ValueError(f"the rendezvous must be tcp://host:port, got {init_method!r}")
    return parsed.hostname, parsed.port


def backend_for(device: str) -> str:
    """NCCL for CUDA ranks, gloo on the CPU (the device setting as the runner resolves it)."""
    import torch

    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
