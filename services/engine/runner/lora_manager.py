"""LoRA adapters on the model runner: load PEFT folders, check them against the model, keep
them in two LRUs (host memory: max_cpu_loras; device: max_loras), and give each step's forward
the adapters of its sequences (layers/lora.py applies them).

An adapter is PEFT's format: adapter_config.json and adapter_model.safetensors (or .bin), with
lora_A / lora_B on q/k/v/o_proj and gate/up/down_proj of the decoder layers. What cannot be
served is refused at load with the reason (InvalidRequest, 400), never at a step: a rank above
max_lora_rank, other target modules (embeddings, the LM head, MoE experts), DoRA, trained
biases or modules_to_save, tensors whose shapes do not fit this model, files that do not parse.
A base_model_name_or_path naming another model only logs a warning, as vLLM does not check it:
the shapes decide.

Under tensor parallelism each rank keeps its slice, cut as its layer's weight is: the rows of B
of a column-parallel layer (q/k/v, gate/up), the columns of A of a row-parallel one (o, down).
Ranks other than 0 load an adapter when a step first names it (the step carries the
LoRARequest); rank 0 checked it first. Pipeline stages load only their own layers.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shoal.services.engine.core.outputs import ScheduledSeq
from shoal.services.engine.layers.linear import Linear, PackedLinear, RowParallelLinear
from shoal.services.engine.layers.lora import DenseGroups, LoRABatch, LoRALayer, LoRAWeights
from shoal.services.engine.lora_request import LoRARequest
from shoal.shared.errors import InvalidRequest

log = logging.getLogger(__name__)

TARGETS: dict[str, tuple[str, str | None]] = {
    "q_proj": ("self_attn.qkv_proj", "q"), "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"), "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", "gate"), "up_proj": ("mlp.gate_up_proj", "up"),
    "down_proj": ("mlp.down_proj", None)}
"""PEFT's module name -> our module (under model.layers.<i>.) and its shard in a packed one."""
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])(?:\.default)?\.weight$")
_OURS = {module for module, _ in TARGETS.values()}
DENSE_MAX_ROWS = 256
"""Steps of at most this many tokens with several adapters run every adapter over every row
(DenseGroups: few dense ops); larger ones (prefill) gather each adapter's rows."""


class LoRAManager:
    def __init__(self, model: nn.Module, *, model_name: str, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None, device: torch.device, dtype: torch.dtype) -> None:
        self.model_name = model_name
        self.max_loras, self.max_rank = max_loras, max_lora_rank
        self.max_cpu = max_cpu_loras or max_loras
        self.device, self.dtype = device, dtype
        self.batch = LoRABatch()
        self.layers: dict[str, Linear] = {}
        for name, module in model.named_modules():
            parts = name.split(".")
            if (isinstance(module, Linear) and len(parts) >= 2
                    and ".".join(parts[-2:]) in _OURS and ".layers." in f".{name}"):
                self.layers[name] = module
                module.lora = LoRALayer(self.batch, name)
        inner = getattr(model, "model", model)
        self.num_layers = len(getattr(inner, "layers", []))
        self.stage = range(getattr(inner, "start", 0), getattr(inner, "end", self.num_layers))
        self.host: OrderedDict[LoRARequest, dict[str, LoRAWeights]] = OrderedDict()
        """Loaded adapters in host memory (float32, this rank's slices), least recent first."""
        self.slots: OrderedDict[LoRARequest, dict[str, LoRAWeights]] = OrderedDict()
        """Adapters on the device in the model's dtype (at most max_loras), least recent first."""
        self._stacks: tuple[tuple[LoRARequest, ...], dict[str, Any]] = ((), {})
        """The stacked weights per layer (DenseGroups), for the step's adapters (in order)."""

    def add(self, lora: LoRARequest) -> None:
        """Load and check an adapter into host memory (no-op when it is there)."""
        if lora in self.host:
            self.host.move_to_end(lora)
            return
        self.host[lora] = self._load(lora)
        while len(self.host) > self.max_cpu:
            self.host.popitem(last=False)

    def remove(self, lora: LoRARequest) -> None:
        self.host.pop(lora, None)
        self.slots.pop(lora, None)
        self._stacks = ((), {})

    def set_batch(self, scheduled: Sequence[ScheduledSeq], num_tokens: Sequence[int]) -> None:
        """Point every LoRA layer at this step's adapters and their token rows."""
        spans: dict[LoRARequest, list[range]] = {}
        pos = 0
        for s, n in zip(scheduled, num_tokens, strict=True):
            if s.lora_request is not None:
                spans.setdefault(s.lora_request, []).append(range(pos, pos + n))
            pos += n
        groups = []
        weights = [self._on_device(lora, spans) for lora in spans]
        if len(spans) >= 2 and pos <= DENSE_MAX_ROWS:
            row_group = [-1] * pos
            for g, ranges in enumerate(spans.values()):
                for r in ranges:
                    row_group[r.start:r.stop] = [g] * len(r)
            key = tuple(spans)
            if self._stacks[0] != key:
                self._stacks = (key, {})
            self.batch.dense = DenseGroups(
                torch.tensor(row_group, dtype=torch.int64, device=self.device), weights,
                self._stacks[1])
            return
        for w, ranges in zip(weights, spans.values(), strict=True):
            rows = [i for r in ranges for i in r]
            groups.append((w, None if len(rows) == pos else  # every row: no gather
                           torch.tensor(rows, dtype=torch.int64, device=self.device)))
        self.batch.groups = groups

    def clear_batch(self) -> None:
        self.batch.groups = []
        self.batch.dense = None

    def _on_device(self, lora: LoRARequest, step: dict[LoRARequest, Any]
                   ) -> dict[str, LoRAWeights]:
        weights = self.slots.get(lora)
        if weights is not None:
            self.slots.move_to_end(lora)
            return weights
        if lora not in self.host:
            self.add(lora)  # a rank > 0 seeing it first, or evicted from the host LRU
        self.host.move_to_end(lora)
        while len(self.slots) >= self.max_loras:
            victim = next((k for k in self.slots if k not in step), None)
            if victim is None:
                raise RuntimeError(f"a step holds more than max_loras={self.max_loras} adapters")
            del self.slots[victim]
        weights = {name: LoRAWeights(w.a.to(self.device, self.dtype),
                                     w.b.to(self.device, self.dtype))
                   for name, w in self.host[lora].items()}
        self.slots[lora] = weights
        return weights

    # Loading and checking -------------------------------------------------------------------

    def _load(self, lora: LoRARequest) -> dict[str, LoRAWeights]:
        name = lora.lora_name

        def refuse(reason: str) -> InvalidRequest:
            return InvalidRequest(f"LoRA adapter {name!r} cannot be loaded: {reason}",
                                  param="lora_path")

        folder = Path(lora.lora_path)
        if not folder.is_dir():
            raise refuse(f"{lora.lora_path} is not a folder")
        try:
            config = json.loads((folder / "adapter_config.json").read_text())
        except FileNotFoundError:
            raise refuse(f"{folder} has no adapter_config.json") from None
        except (OSError, ValueError) as exc:
            raise refuse(f"adapter_config.json does not parse: {exc}") from None
        if not isinstance(config, dict):
            raise refuse("adapter_config.json is not a JSON object")
        scaling = self._check_config(config, refuse)
        tensors = _read_tensors(folder, refuse)
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            match = _KEY.match(key)
            if match is None or match.group(2) not in TARGETS:
                raise refuse(f"tensor {key!r} is not a LoRA weight of a supported module "
                             f"(supported: {', '.join(TARGETS)} of the decoder layers)")
            layer = int(match.group(1))
            if layer >= self.num_layers:
                raise refuse(f"tensor {key!r}: the model has {self.num_layers} layers")
            pairs.setdefault((layer, match.group(2)), {})[match.group(3)] = tensor
        if not pairs:
            raise refuse("the adapter holds no LoRA weights")
        shards: dict[str, list[tuple[str | None, torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), ab in sorted(pairs.items()):
            if set(ab) != {"A", "B"}:
                raise refuse(f"layer {layer} {module} has lora_{''.join(ab)} only")
            if layer not in self.stage:
                continue  # another pipeline stage's layer
            ours, shard = TARGETS[module]
            path = f"model.layers.{layer}.{ours}"
            target = self.layers.get(path)
            if target is None:
                raise refuse(f"layer {layer} {module} is not a plain linear layer in this model "
                             "(a mixture-of-experts layer?): unsupported target module")
            a, b = ab["A"].float(), ab["B"].float()
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
                raise refuse(f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)} are not a rank-r pair")
            if a.shape[0] > self.max_rank:
                raise refuse(f"layer {layer} {module} has rank {a.shape[0]}, greater than "
                             f"max_lora_rank {self.max_rank}")
            a, b = _this_rank(target, shard, a, b, f"layer {layer} {module}", refuse)
            shards.setdefault(path, []).append((shard, a, b * scaling))
        return {path: _packed(self.layers[path], parts) for path, parts in shards.items()}

    def _check_config(self, config: dict[str, Any], refuse: Any) -> float:
        """The adapter's scaling (lora_alpha / r, or / sqrt(r) with rsLoRA), after refusing what
        the config says cannot be served."""
        peft_type = str(config.get("peft_type", "LORA")).upper()
        if peft_type != "LORA":
            raise refuse(f"peft_type {peft_type} is not LORA")
        r = config.get("r")
        if not isinstance(r, int) or r < 1:
            raise refuse(f"r must be a positive integer, got {r!r}")
        if r > self.max_rank:
            raise refuse(f"its rank {r} is greater than max_lora_rank {self.max_rank}")
        for key, what in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save"),
                          ("fan_in_fan_out", "fan_in_fan_out"), ("rank_pattern", "rank_pattern"),
                          ("alpha_pattern", "alpha_pattern")):
            if config.get(key):
                raise refuse(f"{what} is not supported")
        if config.get("bias", "none") not in ("none", None):
            raise refuse(f"trained biases (bias={config.get('bias')!r}) are not supported")
        targets = config.get("target_modules")
        if isinstance(targets, list):
            other = sorted(str(t) for t in targets if str(t).split(".")[-1] not in TARGETS)
            if other:
                raise refuse(f"target modules {other} are not supported (supported: "
                             f"{', '.join(TARGETS)})")
        base = config.get("base_model_name_or_path")
        if base and _model_stem(str(base)) != _model_stem(self.model_name):
            log.warning("LoRA adapter was trained for %s, this engine serves %s: loading it "
                        "anyway (its shapes fit)", base, self.model_name)
        alpha = config.get("lora_alpha", r)
        if not isinstance(alpha, int | float):
            raise refuse(f"lora_alpha must be a number, got {alpha!r}")
        return float(alpha) / (math.sqrt(r) if config.get("use_rslora") else r)


def _read_tensors(folder: Path, refuse: Any) -> dict[str, torch.Tensor]:
    try:
        if (folder / "adapter_model.safetensors").is_file():
            from safetensors.torch import load_file

            return load_file(str(folder / "adapter_model.safetensors"))
        if (folder / "adapter_model.bin").is_file():
            loaded = torch.load(folder / "adapter_model.bin", map_location="cpu", weights_only=True)
            if not isinstance(loaded, dict):
                raise ValueError("not a dict of tensors")
            return loaded
    except Exception as exc:  # a corrupt file is the adapter's problem, never the engine's
        raise refuse(f"its weights file does not load: {exc}") from None
    raise refuse(f"{folder} has no adapter_model.safetensors (nor adapter_model.bin)")


def _this_rank(layer: Linear, shard: str | None, a: torch.Tensor, b: torch.Tensor, where: str,
               refuse: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Check a pair against the layer's full shape and keep this rank's slice."""
    if isinstance(layer, PackedLinear):
        assert shard is not None
        _, size = layer.shard_offsets[shard]
        start, total = layer.source_rows[shard]
        expect_a, expect_b = (a.shape[0], layer.in_features), (total, a.shape[0])
    elif isinstance(layer, RowParallelLinear):
        expect_a, expect_b = (a.shape[0], layer.in_total), (layer.out_features, a.shape[0])
    else:
        expect_a, expect_b = (a.shape[0], layer.in_features), (layer.out_features, a.shape[0])
    if tuple(a.shape) != expect_a or tuple(b.shape) != expect_b:
        raise refuse(f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                     f"this model (expected {expect_a} / {expect_b}): an adapter of another "
                     "base model")
    if isinstance(layer, PackedLinear):
        return a.contiguous(), b.narrow(0, start, size).contiguous()
    if isinstance(layer, RowParallelLinear):
        width = layer.in_features
        return a.narrow(1, layer.parallel.tp_rank * width, width).contiguous(), b.contiguous()
    return a.contiguous(), b.contiguous()


def _packed(layer: Linear, parts: list[tuple[str | None, torch.Tensor, torch.Tensor]]
            ) -> LoRAWeights:
    """One A (the shards' ranks stacked) and one block-diagonal B for the layer's output."""
    if len(parts) == 1 and parts[0][0] is None:
        _, a, b = parts[0]
        return LoRAWeights(a, b)
    assert isinstance(layer, PackedLinear)
    a = torch.cat([p[1] for p in parts])
    b = torch.zeros(layer.out_features, a.shape[0])
    col = 0
    for shard, part_a, part_b in parts:
        offset, size = layer.shard_offsets[shard]  # type: ignore[index]
        b[offset:offset + size, col:col + part_a.shape[0]] = part_b
        col += part_a.shape[0]
    return LoRAWeights(a, b)


def _model_stem(name: str) -> str:
    stem = Path(name.rstrip("/")).name.lower()
    return stem.removesuffix(".gguf")
