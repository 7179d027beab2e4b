"""Synthetic fleets, models and placed instances for the scheduler's unit tests and benchmark."""

from __future__ import annotations

from datetime import datetime, UTC
from itertools import count

from shoal.services.scheduler.claim import ModelProfile, ModelShape
from shoal.shared.schemas.registry import (
    DeviceStatus, GpuDevice, InstancePublic, ModelSpec, Placement, WorkerPublic
)
from shoal.shared.states import InstanceState, WorkerState

GIB = 1024**3
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def worker(name: str, gpus: list[float] | int = 0, gpu_gib: float = 80.0, *, ram_gib: float = 256,
           gpu_name: str = "NVIDIA H100 80GB", labels: dict[str, str] | None = None,
           state: WorkerState = WorkerState.READY) -> WorkerPublic:
    """A worker; `gpus` is a count of `gpu_gib` GPUs or a list of sizes in GiB."""
    sizes = [gpu_gib] * gpus if isinstance(gpus, int) else gpus
    devices = [GpuDevice(index=i, name=gpu_name, memory_total=int(s * GIB))
               for i, s in enumerate(sizes)]
    return WorkerPublic(
        id=f"wid-{name}", name=name, hostname=name, labels=labels or {}, simulated=True,
        state=state, status=DeviceStatus(cpu_cores=32, memory_total=int(ram_gib * GIB),
                                         gpus=devices),
        last_heartbeat_at=NOW, created_at=NOW, updated_at=NOW, version=1)


def profile(params_b: float = 7.0, *, layers: int = 32, heads: int = 32, kv_heads: int = 8,
            hidden: int = 4096, head_dim: int | None = None, max_len: int = 4096,
            vocab: int = 32000, causal: bool = True) -> ModelProfile:
    """A model of `params_b` billion parameters with the given attention shape."""
    shape = ModelShape(
        architecture="LlamaForCausalLM" if causal else "BertModel", num_layers=layers,
        hidden_size=hidden, num_attention_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim or hidden // heads, intermediate_size=hidden * 3, vocab_size=vocab,
        max_position_embeddings=max_len, is_causal_lm=causal)
    return ModelProfile(source="/models/synthetic", format="config", shape=shape,
                        num_params=int(params_b * 1e9), file_bytes=0, checkpoint_dtype="bfloat16")


def spec(**kwargs: object) -> ModelSpec:
    return ModelSpec(source=str(kwargs.pop("source", "/models/synthetic")), **kwargs)  # type: ignore[arg-type]


_ids = count(1)


def placed(placement: Placement, *, model_id: str = "m1",
           state: InstanceState = InstanceState.RUNNING) -> InstancePublic:
    """The instance the registry would hold after accepting `placement`."""
    n = next(_ids)
    return InstancePublic(
        id=f"i{n}", name=f"inst-{n}", model_id=model_id, model_name=model_id, state=state,
        worker_id=placement.worker_id, gpu_indexes=placement.gpu_indexes, claim=placement.claim,
        tp=placement.tp, pp=placement.pp, subordinate_workers=placement.subordinate_workers,
        warnings=placement.warnings, created_at=NOW, updated_at=NOW, state_changed_at=NOW,
        version=1)


def claimed_gpu(worker_id: str, gpu: int, num_bytes: int,
                state: InstanceState = InstanceState.RUNNING) -> InstancePublic:
    """An instance that claims `num_bytes` of one GPU (to pre-fill a fleet)."""
    from shoal.shared.schemas.registry import ResourceClaim

    return placed(Placement(worker_id=worker_id, gpu_indexes=[gpu],
                            claim=ResourceClaim(gpu_memory={gpu: num_bytes})), state=state)
