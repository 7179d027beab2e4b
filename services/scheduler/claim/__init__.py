"""The claim of a model: what one instance needs in GPU memory or RAM, read from its files unloaded.

`read_profile(source)` reads shapes and parameter counts (safetensors headers, GGUF metadata, or
config.json alone); `compute_claim(profile, spec, device)` turns them into a `ModelClaim`;
`check_runnable(spec, profile)` refuses what the model can never run with.
"""

from __future__ import annotations

from shoal.services.scheduler.claim.model_claim import ModelClaim, compute_claim
from shoal.services.scheduler.claim.profile import ModelProfile, ModelShape, read_profile
from shoal.services.scheduler.claim.runnable import check_runnable

__all__ = ["ModelClaim", "ModelProfile", "ModelShape", "check_runnable", "compute_claim",
           "read_profile"]
