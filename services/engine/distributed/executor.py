"""MultiprocExecutor: the model runner of a tp x pp engine, as vLLM splits it. The driver (rank 0,
in the engine's own process, beside the scheduler) broadcasts each step's SchedulerOutput, every
rank runs the same step over its shard, and the RunnerOutput comes from the last stage's first
rank. It satisfies engine_core.Runner, so the scheduler and the front ends do not change.

Offline it starts ranks 1..n-1 itself on this machine (rank_process.py, each pinned to its share
of the cores), with the rendezvous on a free local port. When serving, the worker agent starts the
ranks and passes `distributed_init_method`; `spawn_ranks=False` then.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from dataclasses import asdict, replace
from datetime import timedelta
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from transformers import AutoConfig

from shoal.services.engine.config import EngineConfig
from shoal.services.engine.distributed.launch import RankLaunch, core_shares
from shoal.services.engine.distributed.parallel_state import (
    ParallelContext, check_parallel_shapes
)
from shoal.services.engine.distributed.rank_process import (
    RENDEZVOUS_TIMEOUT_S, backend_for, joined_key, parse_init_method
)
from shoal.services.engine.core.outputs import RunnerOutput, SchedulerOutput
from shoal.services.engine.lora_request import LoRARequest
from shoal.shared.errors import ShoalError

log = logging.getLogger(__name__)
RENDEZVOUS_POLL_S = 0.1
PEER_REPORT_S = 5.0
"""How long a failed step waits for a subordinate worker to say which of its ranks ended."""


class RankFailed(ShoalError):
    """A rank of a parallel engine died or stopped answering: the engine cannot go on."""

    code = "engine_rank_failed"


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, model_dir: Path, *, spawn_ranks: bool = True,
                 local_ranks: list[int] | None = None,
                 peer_failures: Callable[[], dict[int, str]] | None = None) -> None:
        """local_ranks: the ranks > 0 this executor starts (default: all of them when
        spawn_ranks); the others are started elsewhere (a subordinate worker's agent) and join
        the rendezvous at `config.distributed_init_method`. peer_failures: rank -> what ended
        it, for ranks started elsewhere (filled from the bus while this waits)."""
        self.tp, self.pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.world_size = self.tp * self.pp
        self.peer_failures = peer_failures or dict
        check_parallel_shapes(AutoConfig.from_pretrained(model_dir), self.tp, self.pp)
        if dist.is_initialized():
            raise ShoalError("this process already drives a parallel engine (one per process)")
        init_method = config.distributed_init_method or f"tcp://127.0.0.1:{_free_port()}"
        if local_ranks is None:
            local_ranks = list(range(1, self.world_size)) if spawn_ranks else []
        here = [0, *local_ranks]
        shares = dict(zip(here, core_shares(sorted(os.sched_getaffinity(0)), len(here)),
                          strict=True))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        for rank in local_ranks:
            self.procs[rank] = _start_rank(_launch(config, rank, shares[rank], init_method,
                                                   model_dir))
        own = _launch(config, 0, shares[0], init_method, model_dir).config  # in this process
        rank0 = replace(config, num_threads=own["num_threads"], device=own["device"])
        try:
            if backend_for(rank0.device) == "nccl":
                import torch

                torch.cuda.set_device(rank0.device)
            store = self._rendezvous(init_method)
            dist.init_process_group(backend_for(config.device), store=store, rank=0,
                                    world_size=self.world_size,
                                    timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
            self.parallel = ParallelContext.create(0, self.tp, self.pp)
            from shoal.services.engine.runner.model_runner import ModelRunner

            self.runner = ModelRunner(rank0, model_dir, self.parallel)
        except BaseException as exc:
            self.close(graceful=False)
            raise self._failure(exc) from exc
        self.max_model_len = self.runner.max_model_len
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.eos_token_ids = self.runner.eos_token_ids
        self.vocab_size = self.runner.vocab_size
        self.settings = f"{self.runner.settings}; TP={self.tp} PP={self.pp}"
        self._closed = False

    def add_lora(self, lora: LoRARequest) -> None:
        """Rank 0 loads and checks the adapter; the other ranks load their slices when a step
        first names it (the step carries the LoRARequest)."""
        self.runner.add_lora(lora)

    def remove_lora(self, lora: LoRARequest) -> None:
        self.runner.remove_lora(lora)  # the other ranks' LRUs let it go in time

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        stats = self.parallel.stats
        try:
            with stats.timed("broadcast_step"):
                dist.broadcast_object_list([out], src=0)
            result = self.runner.execute(out)
            if self.parallel.output_rank != 0:
                box: list[object] = [None]
                with stats.timed("recv_output"):  # includes the later stages' compute
                    dist.recv_object_list(box, src=self.parallel.output_rank)
                result = box[0]  # type: ignore[assignment]
        except RuntimeError as exc:  # a peer is gone: stop the others, name the dead
            failure = self._failure(exc)
            self.close(graceful=False)
            raise failure from exc
        return result

    def _rendezvous(self, init_method: str) -> dist.TCPStore:
        """Rank 0's TCPStore, returned once every rank has checked in: a rank that dies first
        (here or on another worker) is named at once, not at the store's timeout."""
        host, port = parse_init_method(init_method)
        store = dist.TCPStore(host, port, self.world_size, is_master=True,
                              timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
                              wait_for_workers=False)
        keys = [joined_key(rank) for rank in range(1, self.world_size)]
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
        while not store.check(keys):
            if self.dead_ranks() or self.peer_failures():
                raise RuntimeError("a rank ended before the rendezvous")
            if time.monotonic() > deadline:
                missing = [r for r in range(1, self.world_size)
                           if not store.check([joined_key(r)])]
                raise RankFailed(f"parallel engine (TP={self.tp} PP={self.pp}): rank(s) "
                                 f"{', '.join(map(str, missing))} did not join the rendezvous "
                                 f"at {init_method} within {RENDEZVOUS_TIMEOUT_S} s")
            time.sleep(RENDEZVOUS_POLL_S)
        return store

    def dead_ranks(self) -> dict[int, int]:
        """rank -> exit code, for the ranks this executor started that are gone."""
        return {rank: p.returncode for rank, p in self.procs.items() if p.poll() is not None}

    def close(self, graceful: bool = True) -> None:
        """Tell the ranks to stop (a None step), then reap them; kill what does not exit; free
        rank 0's model and KV cache, held in this process."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if getattr(self, "runner", None) is not None:
            self.runner.close()
        if dist.is_initialized():
            if graceful and not self.dead_ranks() and not self.peer_failures():
                try:
                    dist.broadcast_object_list([None], src=0)
                except RuntimeError:
                    pass
            dist.destroy_process_group()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10 if graceful else 0.1)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _failure(self, exc: BaseException) -> BaseException:
        """Name the rank(s) that ended: ours from their exit codes, the others' from the bus.
        The socket may close before the exit is seen, so wait a moment for a name."""
        wait = PEER_REPORT_S if len(self.procs) < self.world_size - 1 else 2.0
        deadline = time.monotonic() + wait
        while True:
            dead, peers = self.dead_ranks(), self.peer_failures()
            if dead or peers or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        named = {r: f"rank {r} exited with code {c}" for r, c in dead.items()}
        named.update({r: what for r, what in peers.items() if r not in named})
        if not named:
            return exc
        text = ", ".join(named[r] for r in sorted(named))
        return RankFailed(f"parallel engine (TP={self.tp} PP={self.pp}): {text}")


def _launch(config: EngineConfig, rank: int, cores: list[int], init_method: str,
            model_dir: Path) -> RankLaunch:
    """A rank of this machine: its share of the cores and, on CUDA, its own device."""
    device = config.device
    if backend_for(device) == "nccl" and ":" not in device:
        device = f"cuda:{rank}"
    return RankLaunch.build(rank=rank, config=asdict(config), cores=cores,
                            init_method=init_method, device=device, model_dir=str(model_dir))


def _start_rank(launch: RankLaunch) -> subprocess.Popen[bytes]:
    return subprocess.Popen(launch.argv(), env=launch.env(os.environ))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
