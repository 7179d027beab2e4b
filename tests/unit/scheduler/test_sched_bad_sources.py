"""A model source that cannot be read or parsed is an InvalidRequest naming `source` with the
precise reason, whatever the file holds; and a spec that can never run (a tp the heads cannot
split, a context past the model's) is refused naming its field, by the engine's own rule."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
from tests.unit.scheduler.sched_fleet import profile, spec

from shoal.services.engine import ConfigError, context_limit, resolve_max_model_len
from shoal.services.scheduler.claim import compute_claim, read_profile
from shoal.services.scheduler.planner import ProfileCache, build_request
from shoal.services.scheduler.policies.base import PlacementRequest
from shoal.services.scheduler.policies.selectors.common import valid_tp_sizes
from shoal.shared.errors import InvalidRequest, NotFound, ShoalError

GOOD = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
        "vocab_size": 100, "max_position_embeddings": 1024}


def folder(tmp_path: Path, name: str, config: bytes) -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_bytes(config)
    return path


def bad_gguf(tmp_path: Path) -> dict[str, Path]:
    """.gguf files whose headers lie: a truncated one, an absurd tensor count, an unknown value
    type, and a block count that is text."""
    def kv_string(key: str, value: str) -> bytes:
        k, v = key.encode(), value.encode()
        return (struct.pack("<Q", len(k)) + k + struct.pack("<I", 8)
                + struct.pack("<Q", len(v)) + v)

    head = b"GGUF" + struct.pack("<I", 3)
    files = {
        "short": b"GGUF",
        "huge-count": head + struct.pack("<QQ", 2**40, 1) + bytes(64),
        "bad-type": head + struct.pack("<QQ", 0, 1) + struct.pack("<Q", 4) + b"abcd"
        + struct.pack("<I", 99) + bytes(64),
        "text-count": head + struct.pack("<QQ", 0, 2) + kv_string("general.architecture", "llama")
        + kv_string("llama.block_count", "many") + bytes(64),
    }
    out = {}
    for name, data in files.items():
        out[name] = tmp_path / f"{name}.gguf"
        out[name].write_bytes(data)
    return out


@pytest.mark.parametrize(("config", "reason"), [
    (b'{"hidden_size": 64,\n "num_attention_heads": 4,\n}', "is not valid JSON: Expecting "
                                                            "property name"),
    (b"\xff\xfe{}", "is not UTF-8"),
    (b"[1, 2]", "is a JSON array, not an object"),
    (b'"llama"', "is a JSON string, not an object"),
    (json.dumps({**GOOD, "hidden_size": "wide"}).encode(), "hidden_size must be a positive "
                                                           "integer, got 'wide'"),
    (json.dumps({**GOOD, "num_attention_heads": 0}).encode(), "num_attention_heads must be a "
                                                              "positive integer, got 0"),
    (json.dumps({**GOOD, "architectures": {"a": 1}}).encode(), "architectures must be a list"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "num_hidden_layers"}).encode(),
     "lacks num_hidden_layers"),
])
def test_a_malformed_config_is_a_400_naming_source(tmp_path: Path, config: bytes,
                                                   reason: str) -> None:
    path = folder(tmp_path, "m", config)
    for read in (read_profile, ProfileCache().get):
        with pytest.raises(InvalidRequest) as caught:
            read(str(path))
        assert caught.value.param == "source" and reason in caught.value.message, caught.value
        assert "config.json" in caught.value.message


def test_malformed_safetensors_headers_are_named(tmp_path: Path) -> None:
    path = folder(tmp_path, "m", json.dumps(GOOD).encode())
    for body, reason in ((b"\xff" * 8, "not valid JSON"),
                         (b"[1]", "is a JSON array, not an object"),
                         (json.dumps({"w": {"dtype": "F32"}}).encode(), "'data_offsets'"),
                         (json.dumps({"w": {"dtype": "F32", "shape": ["x"],
                                            "data_offsets": [0, 4]}}).encode(), "'x'")):
        (path / "model.safetensors").write_bytes(struct.pack("<Q", len(body)) + body)
        with pytest.raises(InvalidRequest) as caught:
            read_profile(path)
        assert caught.value.param == "source" and "model.safetensors" in caught.value.message
        assert reason in caught.value.message, caught.value.message


def test_crafted_gguf_headers_are_a_400_naming_source(tmp_path: Path) -> None:
    for name, path in bad_gguf(tmp_path).items():
        with pytest.raises(InvalidRequest) as caught:
            ProfileCache().get(str(path))
        assert caught.value.param == "source", (name, caught.value)
        assert str(path) in caught.value.message and "GGUF" in caught.value.message, name


def test_missing_sources_name_source_too(tmp_path: Path) -> None:
    for source in (tmp_path / "missing", tmp_path):
        with pytest.raises(NotFound) as caught:
            read_profile(source)
        assert caught.value.param == "source"


# ---------------------------------------------------------------- can never run
def test_a_tp_the_heads_cannot_split_is_refused_naming_tp() -> None:
    smol = profile(0.135, layers=30, heads=9, kv_heads=3, hidden=576)  # SmolLM2-135M's shape
    with pytest.raises(InvalidRequest) as caught:
        build_request(spec(tp=2), smol)
    assert caught.value.param == "tp"
    assert "9 attention heads" in caught.value.message
    assert "sizes that work: 1, 3, 9" in caught.value.message
    with pytest.raises(InvalidRequest) as caught:
        build_request(spec(pp=31), smol)
    assert caught.value.param == "pp" and "30 layers" in caught.value.message
    assert build_request(spec(tp=3, pp=2), smol).model.tp == 3
    encoder = profile(0.02, heads=12, kv_heads=12, hidden=384, causal=False)
    with pytest.raises(InvalidRequest) as caught:
        build_request(spec(tp=2), encoder)
    assert caught.value.param == "tp" and "one rank" in caught.value.message


def test_a_context_past_the_models_is_refused_naming_max_model_len() -> None:
    smol = profile(0.135, layers=30, heads=9, kv_heads=3, hidden=576, max_len=8192)
    with pytest.raises(InvalidRequest) as caught:
        build_request(spec(max_model_len=100000), smol)
    assert caught.value.param == "max_model_len"
    assert caught.value.message.startswith(
        "User-specified max_model_len (100000) is greater than the derived max_model_len "
        "(max_position_embeddings=8192")
    assert build_request(spec(max_model_len=8192), smol).gpu_claim.max_model_len == 8192


def test_rope_scaling_stretches_the_context_as_vllm_derives_it(tmp_path: Path) -> None:
    base = {**GOOD, "max_position_embeddings": 4096}
    cases = [({}, 4096), ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, 8192),
             ({"rope_scaling": {"type": "dynamic", "factor": 4}}, 16384),
             ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
              8192),
             ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 4096),  # counted already
             ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 2048}}, 8192)]
    for i, (extra, expected) in enumerate(cases):
        config = {**base, **extra}
        assert context_limit(config).max_model_len == expected, extra
        path = folder(tmp_path, f"m{i}", json.dumps(config).encode())
        p = read_profile(path)  # the scheduler reads the same limit the engine derives
        assert compute_claim(p, spec(), "cpu").max_model_len == expected, extra
        with pytest.raises(InvalidRequest) as caught:
            build_request(spec(max_model_len=expected + 1), p)
        assert caught.value.param == "max_model_len" and str(expected) in caught.value.message
    with pytest.raises(ConfigError) as refused:  # the engine's own check: the same words
        resolve_max_model_len(8193, context_limit({**base, **cases[1][0]}))
    assert "max_position_embeddings=4096 x rope factor 2 (linear)" in refused.value.message


def test_the_scheduler_picks_only_tp_sizes_the_engine_accepts() -> None:
    """One rule: the multi-GPU selector's sizes are the engine's (heads, KV heads replicated
    past their count, and the MLP size)."""
    from shoal.services.engine.distributed.parallel_state import check_parallel_shapes

    shapes = [(8, 2, 3 * 1024), (12, 4, 1000), (9, 3, 1536), (16, 16, 4096)]
    for heads, kv, mlp in shapes:
        p = profile(7, heads=heads, kv_heads=kv, hidden=heads * 64)
        p = p.__class__(**{**{f: getattr(p, f) for f in p.__dataclass_fields__},
                           "shape": p.shape.__class__(**{
                               **{f: getattr(p.shape, f) for f in p.shape.__dataclass_fields__},
                               "intermediate_size": mlp})})
        request = PlacementRequest(model=spec(), gpu_claim=compute_claim(p, spec(), "gpu"),
                                   cpu_claim=None)
        picked = valid_tp_sizes(request, 64)
        engine_ok = []
        for tp in range(2, 65):
            try:
                check_parallel_shapes(SimpleNamespace(
                    num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=mlp,
                    num_hidden_layers=32, architectures=["LlamaForCausalLM"]), tp, 1)
                engine_ok.append(tp)
            except ShoalError:
                pass
        assert picked == engine_ok, (heads, kv, mlp)
