"""A .gguf file as a model folder that leaves its block-stored Linear weights in the file.

The full conversion (model_prep) dequantises every tensor to float32, in memory and on disk: a
Q4_K_M file of 4.6 GB becomes a 32 GB folder and as much RAM while converting, so a 7-8B GGUF
could not start on a 24 GB machine although its blocks (what quantization "gguf" runs) fit easily.
This folder holds the config, the tokenizer and only the tensors that must be dense (embedding,
norms, biases, experts, weights of other types); `gguf-omitted.json` names the Linear weights left
in the file. The loader takes those from the file itself: the block layers (gguf_weights.py) read
their blocks, and any other omitted weight (a type with no block kernel, or quantization "none"
over this folder) is dequantised from it by the gguf package, one tensor at a time.
A weight is left out only when transformers' own processing of it is a row permutation at most
(q/k's rotary order), which the block layers apply to the blocks' rows: the values are the same.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

OMITTED_FILE = "gguf-omitted.json"
Progress = Callable[[str, float], None]


@dataclass(frozen=True, slots=True)
class OmittedWeights:
    """The Linear weights a blocks folder leaves in its GGUF file, by Hugging Face name."""

    gguf: Path
    names: frozenset[str]


def omitted_weights(model_dir: Path) -> OmittedWeights | None:
    """What `model_dir` left in its GGUF file; None for a complete folder."""
    path = Path(model_dir) / OMITTED_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return OmittedWeights(Path(data["gguf"]), frozenset(data["omitted"]))


def write_blocks_folder(gguf_path: Path, folder: Path, report: Progress) -> None:
    """Write config, tokenizer, generation config and the dense tensors of `gguf_path` into
    `folder`, leaving its quantised 2-D weights in the file (those transformers would at most
    reorder by rows; the embedding table stays: the model looks rows up in it)."""
    import gguf
    from safetensors.torch import save_file
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer,
                              GenerationConfig)
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map)

    from shoal.services.engine.gguf_config import gguf_config

    config = gguf_config(gguf_path) or AutoConfig.from_pretrained(gguf_path.parent,
                                                                  gguf_file=gguf_path.name)
    reader = gguf.GGUFReader(str(gguf_path))
    arch = reader.fields["general.architecture"]
    arch_name = bytes(arch.parts[arch.data[0]]).decode()
    with torch.device("meta"):  # the names only: no weights made
        skeleton = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(arch_name, TensorProcessor)(config=config.to_dict())
    key_map = get_gguf_hf_weights_map(skeleton, processor)
    float_types = gguf.GGMLQuantizationType
    FLOATS = {float_types.F32, float_types.F16, float_types.BF16, float_types.F64}
    parsed: dict[str, Any] = {"tensors": {}}
    omitted: list[str] = []
    tensors: dict[str, torch.Tensor] = {}
    total = len(reader.tensors)
    for i, tensor in enumerate(reader.tensors):
        report("reading gguf tensors", 0.7 * i / max(total, 1))
        if tensor.tensor_type not in FLOATS and len(tensor.shape) == 2 \
                and tensor.name in key_map and not tensor.name.startswith("token_embd") \
                and _rows_permuted_at_most(processor, tensor.name, int(tensor.shape[1]), key_map):
            omitted.append(key_map[tensor.name])
            continue
        weights = gguf.dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(weights=weights, name=tensor.name,
                                   tensor_key_mapping=key_map, parsed_parameters=parsed)
        if result.name in key_map:
            tensors[key_map[result.name]] = torch.from_numpy(np.copy(result.weights)).float()
    tensors |= {name: t.float().contiguous() for name, t in parsed["tensors"].items()}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    report("loading gguf tokenizer", 0.7)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    report("writing the dense tensors", 0.8)
    config.architectures = [type(skeleton).__name__]  # (as save_pretrained writes them)
    config.dtype = torch.float32  # the dense tensors'
    config.save_pretrained(folder)
    GenerationConfig.from_model_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / OMITTED_FILE).write_text(json.dumps(
        {"gguf": str(gguf_path.resolve()), "omitted": sorted(omitted)}, indent=1))


def _rows_permuted_at_most(processor: Any, name: str, rows: int, key_map: dict[str, str]) -> bool:
    """Whether transformers' processing of a 2-D tensor keeps its name and only reorders rows
    (probed with one column of row numbers): the block layers then read it as stored."""
    probe = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    try:
        result = processor.process(weights=probe, name=name, tensor_key_mapping={},
                                   parsed_parameters={"tensors": {}})
    except Exception:  # a processor that needs the real values: keep the tensor dense
        return False
    out = np.asarray(result.weights)
    return (result.name == name and out.shape == probe.shape
            and np.array_equal(np.sort(out[:, 0]), probe[:, 0]))
