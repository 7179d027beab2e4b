"""How a rank other than 0 is launched, written once: the engine's executor (offline, and the
lead worker's own ranks) and a subordinate worker's agent (worker/stages.py) both describe a rank
as a RankLaunch, and rank_process.py parses the same command line back into one. Also the one
rule for which cores each rank of a machine gets (`core_shares`).

Torch-free (the worker agent imports it through the engine's public names).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shoal.services.engine.distributed.reach import CONNECT_TIMEOUT_S

RANK_MODULE = "shoal.services.engine.distributed.rank_process"


def core_shares(cores: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Each rank's cores on this machine: an even split, or one core each round-robin when ranks
    outnumber them."""
    cores = list(cores)
    if len(cores) < num_ranks:
        return [[cores[r % len(cores)]] for r in range(num_ranks)]
    per = len(cores) // num_ranks
    return [cores[r * per:(r + 1) * per] for r in range(num_ranks)]


@dataclass(frozen=True, kw_only=True)
class RankLaunch:
    """One rank's process: what `python -m ...rank_process` is given, and its environment."""

    rank: int
    init_method: str
    """tcp://host:port of rank 0's store."""
    config: Mapping[str, Any]
    """The EngineConfig fields this rank runs with (its own threads and device set: `build`)."""
    cores: tuple[int, ...] = ()
    model_dir: str | None = None
    """The prepared model folder; None: the rank prepares `config["model"]` into cache_dir (a
    rank on another worker)."""
    cache_dir: str | None = None
    instance_id: str = ""
    """The instance the rank serves (on its command line, so its processes can be found)."""
    watch_parent: bool = True
    visible_gpus: tuple[int, ...] | None = None
    """CUDA_VISIBLE_DEVICES for the rank (a worker's GPUs of the instance); None: inherited."""
    connect_timeout: float = CONNECT_TIMEOUT_S
    """Seconds rank 0's host may stay unreachable before the rank fails (distributed/reach.py)."""

    @classmethod
    def build(cls, *, rank: int, config: Mapping[str, Any], cores: Sequence[int],
              init_method: str, device: str | None = None, **rest: Any) -> RankLaunch:
        """A rank's launch on its share of the cores: torch threads = the config's num_threads,
        else one per core; `device` replaces the config's (a rank's own CUDA device)."""
        own = dict(config, num_threads=config.get("num_threads") or len(cores))
        if device is not None:
            own["device"] = device
        return cls(rank=rank, init_method=init_method, config=own, cores=tuple(cores), **rest)

    @property
    def num_threads(self) -> int:
        return int(self.config["num_threads"])

    def argv(self) -> list[str]:
        cmd = [sys.executable, "-m", RANK_MODULE, "--rank", str(self.rank),
               "--init-method", self.init_method, "--config", json.dumps(dict(self.config)),
               "--cores", ",".join(map(str, self.cores))]
        if self.model_dir is not None:
            cmd += ["--model-dir", self.model_dir]
        if self.cache_dir is not None:
            cmd += ["--cache-dir", self.cache_dir]
        if self.instance_id:
            cmd += ["--instance-id", self.instance_id]
        if self.watch_parent:
            cmd.append("--watch-parent")
        if self.connect_timeout != CONNECT_TIMEOUT_S:
            cmd += ["--connect-timeout", str(self.connect_timeout)]
        return cmd

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """`base` (the launcher's environment) with the rank's thread count and GPUs."""
        env = {**base, "OMP_NUM_THREADS": str(self.num_threads)}
        if self.visible_gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.visible_gpus))
        return env

    @classmethod
    def parse(cls, argv: Sequence[str] | None = None) -> RankLaunch:
        """The launch rank_process.py was started with (the inverse of `argv`)."""
        parser = argparse.ArgumentParser(prog=f"python -m {RANK_MODULE}",
                                         description="A rank other than 0 of a parallel engine.")
        parser.add_argument("--rank", type=int, required=True)
        parser.add_argument("--init-method", required=True,
                            help="tcp://host:port of rank 0's store")
        parser.add_argument("--model-dir", help="the prepared model folder (default: prepare "
                            "the config's model here, into --cache-dir: a rank on another "
                            "worker)")
        parser.add_argument("--cache-dir", default=None, help="where --model is prepared")
        parser.add_argument("--instance-id", default="", help="the instance this rank serves "
                            "(to find its processes; not used otherwise)")
        parser.add_argument("--config", required=True, help="EngineConfig fields as JSON")
        parser.add_argument("--cores", default="", help="CPU cores for this rank, e.g. 2,3")
        parser.add_argument("--watch-parent", action="store_true",
                            help="exit when the process that started this rank is gone")
        parser.add_argument("--connect-timeout", type=float, default=CONNECT_TIMEOUT_S,
                            help="seconds rank 0's host may stay unreachable before this rank "
                            f"fails (default {CONNECT_TIMEOUT_S:g})")
        args = parser.parse_args(argv)
        return cls(rank=args.rank, init_method=args.init_method,
                   config=json.loads(args.config),
                   cores=tuple(int(c) for c in args.cores.split(",") if c),
                   model_dir=args.model_dir, cache_dir=args.cache_dir,
                   instance_id=args.instance_id, watch_parent=args.watch_parent,
                   connect_timeout=args.connect_timeout)
