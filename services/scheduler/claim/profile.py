"""ModelProfile: a model's shape and weight size, read from its files without loading any weight.

Dispatches on the source: a .gguf file (GGUF metadata + tensor element counts), a Hugging Face
folder with *.safetensors (8-byte length + JSON header of each file), or config.json alone
(parameter count estimated from the shape); a Hugging Face id is read from the Hugging Face
cache (or its config.json fetched from the hub: shared/hf_hub.py). No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shoal.services.engine import ContextLimit, mlp_split_size
from shoal.shared.errors import InvalidRequest, NotFound, ShoalError
from shoal.shared.hf_hub import hub_config_folder, is_hub_id


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the claim and the tensor-parallel rule need from a model's configuration."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    """The dense MLP's width (an MoE's dense layers; Mixtral: each expert's)."""
    vocab_size: int
    max_position_embeddings: int
    is_causal_lm: bool = True
    """False for encoders (embedding models): no KV cache, and the claim is not a GPU fraction."""
    context: ContextLimit | None = None
    """The longest context the engine takes (rope scaling considered: the engine's own rule);
    None: max_position_embeddings."""
    num_experts: int = 0
    """Routed experts per MoE layer (0: a dense model); all of them count in the weights."""
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @property
    def mlp_split_size(self) -> int:
        """The width tensor parallelism must divide (every MLP's: model_limits.py)."""
        return mlp_split_size((self.intermediate_size, self.expert_intermediate_size,
                               self.shared_expert_intermediate_size))

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.num_attention_heads < 1 or self.num_kv_heads < 1:
            raise InvalidRequest(f"model shape has no layers or heads: {self}", param="source")

    @property
    def context_limit(self) -> ContextLimit:
        return self.context or ContextLimit(
            self.max_position_embeddings,
            f"max_position_embeddings={self.max_position_embeddings} in the model's config")


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """A model as the scheduler sees it: shape, element count and the dtype of its files."""

    source: str
    format: str
    """'gguf', 'safetensors' or 'config' (parameter count estimated from the shape)."""
    shape: ModelShape
    num_params: int
    """Weight elements as the engine holds them (GGUF: dequantised, so one element = one value)."""
    file_bytes: int
    """Bytes of weights on disk (quantised for GGUF; 0 when estimated from config.json)."""
    checkpoint_dtype: str
    """The dtype the weights are stored in ('bfloat16', 'float32', 'q4_1', ...)."""


def read_profile(source: str | Path) -> ModelProfile:
    """Read a model's profile from a .gguf file or a Hugging Face folder; nothing is loaded.

    Whatever is wrong with the files (unreadable, not UTF-8, not JSON, a crafted header) is a
    ShoalError with param `source` and the reason, never another exception: one bad model must
    not stop the scheduler from placing the others."""
    try:
        return _read_profile(source)
    except ShoalError as exc:
        exc.param = exc.param or "source"
        raise
    except Exception as exc:  # noqa: BLE001 - any flaw of the files is the caller's bad source
        raise InvalidRequest(f"cannot read the model from {source}: {type(exc).__name__}: {exc}",
                             param="source") from exc


def _read_profile(source: str | Path) -> ModelProfile:
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from shoal.services.scheduler.claim.gguf_profile import read_gguf_profile

        return read_gguf_profile(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise NotFound(f"{path} has no config.json: not a Hugging Face model folder")
        from shoal.services.scheduler.claim.hf_profile import read_hf_profile

        return read_hf_profile(path)
    if path.exists():
        raise InvalidRequest(f"{path} is neither a model folder nor a .gguf file")
    if is_hub_id(str(source)):  # the Hugging Face cache, else config.json from the hub
        from shoal.services.scheduler.claim.hf_profile import read_hf_profile

        return read_hf_profile(hub_config_folder(str(source)))
    raise NotFound(f"model source {path} does not exist (nor is it a Hugging Face id org/name)")
