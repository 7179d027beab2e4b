"""GGUF files written from a tiny Hugging Face folder (tests/tiny_models.py) the way llama.cpp's
convert_hf_to_gguf.py writes them: its architecture string and metadata keys, its tensor names
(`blk.N.attn_q`, `blk.N.ffn_gate_inp`, every expert's projection stacked as
`blk.N.ffn_gate_exps` [experts, inter, hidden]...), q/k rows permuted for the "llama"
architecture (Mixtral is written as llama with experts), Gemma's norms stored as 1 + w, and
SmolLM2's GGUF tokenizer fields cut to the tiny vocabulary (its first tokens, the merges among
them: small, so converting it is quick). fp32 tensors (the test is the names and the layout),
or with `quantize` the attention and MLP weights in that block type (Q8_0, Q4_1: what the gguf
package can write), as llama.cpp's quantizer leaves a file: norms, embedding and experts float.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama",
             "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",
                "w1": "gate", "w3": "up", "w2": "down"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for the llama architecture (its rotary pairs adjacent rows)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


@functools.cache
def _tokenizer_values(source: Path) -> dict[str, Any]:
    reader = gguf.GGUFReader(str(source))
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def _tokenizer_fields(writer: gguf.GGUFWriter, source: Path, vocab: int) -> None:
    value = _tokenizer_values(source).__getitem__
    tokens = value("tokenizer.ggml.tokens")[:vocab]
    known = set(tokens)
    merges = [m for m in value("tokenizer.ggml.merges")
              if (parts := m.split(" ")) and all(p in known for p in parts)
              and "".join(parts) in known]
    writer.add_tokenizer_model(str(value("tokenizer.ggml.model")))
    writer.add_tokenizer_pre(str(value("tokenizer.ggml.pre")))
    writer.add_token_list(tokens)
    writer.add_token_types(value("tokenizer.ggml.token_type")[:vocab])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(int(value("tokenizer.ggml.bos_token_id")))  # type: ignore[arg-type]
    writer.add_eos_token_id(int(value("tokenizer.ggml.eos_token_id")))  # type: ignore[arg-type]
    writer.add_pad_token_id(int(value("tokenizer.ggml.padding_token_id")))  # type: ignore[arg-type]
    writer.add_add_bos_token(False)
    writer.add_chat_template(str(value("tokenizer.chat_template")))


_QUANTIZED = re.compile(
    r"^blk\.\d+\.(attn_(q|k|v|qkv|output)|ffn_(gate|up|down|gate_up))\.weight$")


def write_gguf(folder: Path, dest: Path, tokenizer_gguf: Path,
               quantize: gguf.GGMLQuantizationType | None = None) -> Path:
    """The tiny model in `folder` as a GGUF file at `dest` (see the module docstring)."""
    cfg = json.loads((folder / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = GGUF_ARCH[model_type]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(dest), arch)
    writer.add_name(f"tiny {model_type}")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * cfg.get("partial_rotary_factor", 1.0)))
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # (Gemma 3: per layer type; llama.cpp: the global)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    if rope.get("rope_type") == "longrope":  # llama.cpp: the factors as two tensors
        writer.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    if experts := cfg.get("num_experts") or cfg.get("num_local_experts"):
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch.startswith("gemma"):  # (llama.cpp scales queries by head_dim ** -0.5: no key for it)
        assert cfg["query_pre_attn_scalar"] == head_dim, "llama.cpp cannot write another scalar"
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if "moe_intermediate_size" in cfg:
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _tokenizer_fields(writer, tokenizer_gguf, cfg["vocab_size"])

    names = gguf.get_tensor_name_map(
        {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], cfg["num_hidden_layers"])
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    tensors: dict[str, np.ndarray] = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        if m := _EXPERT.match(name):
            experts.setdefault((int(m[1]), _EXPERT_PROJ[m[3]]), {})[int(m[2])] = tensor
            continue
        base, _, suffix = name.rpartition(".")
        gguf_name = names.get_name(base.replace(".block_sparse_moe.gate", ".mlp.gate"))
        assert gguf_name is not None, name
        array = tensor.numpy()
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            array = _permute(array, heads if base.endswith("q_proj") else kv_heads)
        if gguf_name.endswith("ffn_gate_inp_shexp"):  # llama.cpp: a vector
            array = array.reshape(-1)
        if arch.startswith("gemma") and base.endswith("norm"):  # llama.cpp stores Gemma's 1 + w
            array = array + 1
        tensors[f"{gguf_name}.{suffix}"] = array
    if rope.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            tensors[f"rope_factors_{kind}.weight"] = np.asarray(rope[f"{kind}_factor"], np.float32)
    for (layer, part), by_expert in experts.items():
        stacked = torch.stack([by_expert[e] for e in sorted(by_expert)]).numpy()
        tensors[f"blk.{layer}.ffn_{part}_exps.weight"] = stacked
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        if quantize is not None and _QUANTIZED.match(name):
            writer.add_tensor(name, gguf.quants.quantize(array, quantize), raw_dtype=quantize)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest
