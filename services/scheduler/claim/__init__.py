"""The claim of a model: what one instance needs in GPU memory or RAM, read from its files unloaded.

`read_profile(source)` reads shapes and parameter counts (safetensors headers, GGUF metadata, or
config.json alone); `compute_claim(profile, spec, device)` turns them into a `ModelClaim`.
"""

from __future__ import annotations

from shoal.services.scheduler.claim.model_claim import ModelClaim, compute_claim
from shoal.services.scheduler.claim.profile import ModelProfile, ModelShape, read_profile

__all__ = ["ModelClaim", "ModelProfile", "ModelShape", "compute_claim", "read_profile"]
