"""LoRARequest: which LoRA adapter a request runs with (vLLM's class, names and fields).

Torch-free, so the core (scheduler, block hashes) and the front ends share it; the runner loads
the adapter (runner/lora_manager.py). An adapter's identity is the whole request (name, id and
path): caches key on it, so an id reused for another folder never finds the old weights, and a
sequence's prefix-cache hashes start from `hash_root`, so two adapters never share KV blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from shoal.shared.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str
    """The adapter's name: what a served request's `model` says."""
    lora_int_id: int
    """A positive id, unique among the engine's adapters (0 is the base model)."""
    lora_path: str = ""
    """The PEFT folder: adapter_config.json + adapter_model.safetensors (or .bin)."""
    base_model_name: str | None = None
    """The model it was trained for (vLLM's field; informational)."""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequest(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}",
                                 param="lora_int_id")
        if not self.lora_name:
            raise InvalidRequest("lora_name must not be empty", param="lora_name")
        if not self.lora_path:
            raise InvalidRequest(f"LoRA adapter {self.lora_name!r} has no lora_path",
                                 param="lora_path")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of lora_int_id."""
        return self.lora_int_id

    @property
    def hash_root(self) -> int:
        """The 'parent hash' of a sequence's first KV block under this adapter: block hashes
        chain from it, so only sequences of the same adapter can hit each other's blocks."""
        key = f"lora\0{self.lora_int_id}\0{self.lora_name}\0{self.lora_path}"
        return xxhash.xxh64_intdigest(key.encode())
