"""Load safetensors checkpoints into our model through each parameter's weight_loader.

Checkpoint names are transformers'; `packed_modules_mapping` routes q/k/v and gate/up shards
into the packed parameters, and a family's `checkpoint_target` the names it maps otherwise (an
MoE's per-expert tensors into its stacked experts): nano-vllm's 28-line loader, plus a check
that nothing was missed. `load_format="dummy"` (vLLM's) skips the files: every floating-point
parameter gets seeded uniform values in +-1e-3, as vLLM's DummyModelLoader gives them.
Under tensor / pipeline parallelism a rank reads only the tensors of its stage (the model's
`skipped_prefixes`), one at a time, and its parameters' loaders keep only its slice of each.
A model is built inside `building_in(dtype, device)`: its parameters are made in the serving
dtype where they will live, so loading peaks at the weights' bytes (plus the tensor being read),
not at a float32 copy of them (twice a bf16 model's bytes, which used to be built first).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from shoal.services.engine.config import ConfigError
from shoal.services.engine.layers.linear import default_weight_loader


@contextmanager
def building_in(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Tensors made without a dtype or device are `dtype` on `device` while a model is built.
    What a module computes at build in float32 (rotary cos/sin) says so, and stays float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


DUMMY_RANGE = (-1e-3, 1e-3)
DUMMY_SEED = 1234
"""vLLM's initialize_dummy_weights defaults: small enough that no activation overflows."""


def initialize_dummy_weights(model: nn.Module, low: float = DUMMY_RANGE[0],
                             high: float = DUMMY_RANGE[1], seed: int = DUMMY_SEED) -> None:
    """Every floating-point parameter uniform in [low, high), the same values for the same
    model and seed (drawn in float32, then cast: half types have too few bits to draw in)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                values = torch.empty(param.shape, dtype=torch.float32)
                values.uniform_(low, high, generator=gen)
                param.copy_(values.to(param.dtype))


def load_model_weights(model: nn.Module, model_dir: Path, load_format: str = "auto",
                       supplied: frozenset[str] = frozenset()) -> None:
    """The weights as `load_format` says (EngineConfig.load_format): read or random.
    `supplied`: Hugging Face weight names another kernel brings (a GGUF's block layers): their
    parameters are left unread (never touched, so never resident)."""
    if load_format == "dummy":
        initialize_dummy_weights(model)
    else:
        load_weights(model, model_dir, supplied)


def load_weights(model: nn.Module, model_dir: Path, supplied: frozenset[str] = frozenset()
                 ) -> None:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir} has no *.safetensors files")
    params = dict(model.named_parameters())  # tied weights appear once, under the embedding
    mapping: dict[str, tuple[str, str]] = getattr(model, "packed_modules_mapping", {})
    tied = bool(getattr(model, "tie_word_embeddings", False))
    skipped: tuple[str, ...] = getattr(model, "skipped_prefixes", ())
    route = getattr(model, "checkpoint_target", None)
    # prefixed to names saved without it (a decoder embedder's trunk saved alone)
    bare: str = getattr(model, "bare_checkpoint_prefix", "")
    renamed = {}
    if tied and "model.embed_tokens.weight" not in params and "lm_head.weight" in params:
        renamed["model.embed_tokens.weight"] = "lm_head.weight"  # a last stage's tied head
    loaded: set[str] = set()

    def target_of(key: str) -> tuple[str, str | None] | None:
        """Our parameter (and shard) for a checkpoint name; None for one we skip."""
        name = bare + key if bare and not key.startswith((bare, "lm_head.")) else key
        if ("rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")
                or (name.startswith(skipped) and name not in renamed)):
            return None
        target, shard_id = renamed.get(name, name), None
        routed = route(name) if route is not None else None
        if routed is not None:  # an expert weight (layers/moe.py), a renamed module
            target, shard_id = routed
        else:
            for hf_part, (our_part, shard) in mapping.items():
                if f".{hf_part}." in name:
                    target, shard_id = name.replace(hf_part, our_part), shard
                    break
        if target not in params:
            raise ConfigError(f"checkpoint tensor {name!r} has no parameter in our model")
        return target, shard_id

    def load(key: str, tensor: torch.Tensor) -> None:
        found = target_of(key)
        if found is None:
            return
        target, shard_id = found
        param = params[target]
        loader = getattr(param, "weight_loader", default_weight_loader)
        if shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
        loaded.add(target)

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                load(key, f.get_tensor(key))
    _load_omitted(model_dir, supplied, load, target_of, loaded)
    missing = set(params) - loaded
    if missing:
        raise ConfigError(f"checkpoint in {model_dir} lacks {sorted(missing)[:5]}")
    for name, module in model.named_modules():  # a tensor read but waiting for its partner
        if (unpaired := getattr(module, "unpaired", None)) and unpaired():
            raise ConfigError(f"checkpoint in {model_dir}: {name} lacks {unpaired()}")


def _load_omitted(model_dir: Path, supplied: frozenset[str],
                  load: Callable[[str, torch.Tensor], None],
                  target_of: Callable[[str], tuple[str, str | None] | None],
                  loaded: set[str]) -> None:
    """A GGUF blocks folder's weights left in the file (gguf_folder.py): those the block layers
    bring count as loaded; any other is dequantised from the file, one at a time."""
    from shoal.services.engine.gguf_folder import omitted_weights

    omitted = omitted_weights(model_dir)
    if omitted is None:
        return
    rest = sorted(omitted.names - supplied)
    for name in omitted.names & supplied:
        if (found := target_of(name)) is not None:
            loaded.add(found[0])
    if not rest:
        return
    from gguf import dequantize

    from shoal.services.engine.layers.gguf_weights import GGUFSource

    source = GGUFSource(omitted.gguf)
    for name in rest:
        found = source.raw(name)  # (rows in Hugging Face order)
        if found is None:
            raise ConfigError(f"{omitted.gguf} lacks {name} (the file changed after conversion?)")
        ggml_type, raw = found
        load(name, torch.from_numpy(dequantize(raw, ggml_type).astype("float32")))
