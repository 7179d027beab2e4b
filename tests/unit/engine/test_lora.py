"""LoRA adapters in the engine beyond parity (tests/parity/test_lora_parity.py): what is
refused at load and why, with the engine still serving afterwards; the prefix cache never
serving one adapter's blocks to another; the configuration's refusals."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from shoal.services.engine import LLM, ConfigError, LoRARequest, SamplingParams
from shoal.shared.errors import InvalidRequest
from tests.lora_adapters import save_adapter
from tests.tiny_models import save_tiny_model

ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=128,
              enable_lora=True, max_loras=2, max_lora_rank=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("lora-unit")
    base = save_tiny_model("qwen3_moe", root / "base", seed=1)  # layer 1 dense, 0 and 2 MoE
    attn = save_adapter(base, root / "attn", targets=["q_proj", "o_proj"], r=4, seed=1)
    return base, attn, root


@pytest.fixture(scope="module")
def llm(tiny: tuple[Path, Path, Path]) -> LLM:
    return LLM(str(tiny[0]), **ENGINE)


def _broken(src: Path, dest: Path, **config: object) -> Path:
    shutil.copytree(src, dest)
    data = json.loads((dest / "adapter_config.json").read_text())
    data.update(config)
    (dest / "adapter_config.json").write_text(json.dumps(data))
    return dest


def test_refusals_name_the_reason_and_leave_the_engine_serving(
        llm: LLM, tiny: tuple[Path, Path, Path]) -> None:
    base, attn, root = tiny
    corrupt = _broken(attn, root / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 10)
    cases = {
        "rank 16 is greater than max_lora_rank 8":
            save_adapter(base, root / "r16", targets=["q_proj"], r=16, seed=2),
        "not a LoRA weight of a supported module": (  # the experts of an MoE layer
            save_adapter(base, root / "moe", targets=["down_proj"], r=4, seed=3)),
        "target modules ['lm_head'] are not supported": _broken(
            attn, root / "head", target_modules=["q_proj", "lm_head"]),
        "DoRA is not supported": _broken(attn, root / "dora", use_dora=True),
        "weights file does not load": corrupt,
        "is not a folder": root / "missing",
        "do not fit this model": save_adapter(  # an adapter of another base model
            save_tiny_model("llama", root / "other"), root / "other-lora", targets=["q_proj"],
            r=4),
    }
    for i, (reason, path) in enumerate(cases.items(), start=10):
        lora = LoRARequest(f"bad{i}", i, str(path))
        with pytest.raises(InvalidRequest, match=reason.replace("[", r"\[")) as info:
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=lora)
        assert info.value.param == "lora_path" and f"'bad{i}'" in info.value.message
        assert i not in llm.list_loras()
    good = LoRARequest("attn", 1, str(attn))
    base_out, lora_out = llm.generate([[5, 6, 7, 8]] * 2, GREEDY, use_tqdm=False,
                                      lora_request=[None, good])
    assert base_out.outputs[0].token_ids != lora_out.outputs[0].token_ids
    with pytest.raises(InvalidRequest, match="already used by adapter 'attn'"):
        llm.add_lora(LoRARequest("other", 1, str(root / "r16")))


def test_prefix_cache_is_per_adapter(llm: LLM, tiny: tuple[Path, Path, Path]) -> None:
    base, attn, root = tiny
    second = save_adapter(base, root / "second", targets=["q_proj", "o_proj"], r=4, seed=9)
    a, b = LoRARequest("attn", 1, str(attn)), LoRARequest("second", 2, str(second))
    prompt = list(range(20, 45))  # six full blocks of 4

    def cached(lora: LoRARequest | None) -> tuple[int, list[int]]:
        out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    first_a = cached(a)
    assert cached(b)[0] == 0 and cached(None)[0] == 0  # the same tokens, other adapters: misses
    again_a = cached(a)
    assert again_a[0] >= 20 and again_a[1] == first_a[1]  # its own blocks: a hit, same tokens
    assert cached(b)[0] >= 20 and cached(None)[0] >= 20
    fresh = LLM(str(base), **ENGINE)  # and each adapter's output with a cold cache is the same
    assert fresh.generate([prompt], GREEDY, use_tqdm=False,
                          lora_request=b)[0].outputs[0].token_ids == cached(b)[1]


def test_base_model_name_mismatch_warns(llm: LLM, tiny: tuple[Path, Path, Path],
                                        caplog: pytest.LogCaptureFixture) -> None:
    _, attn, root = tiny
    other = _broken(attn, root / "renamed", base_model_name_or_path="meta-llama/Llama-3-8B")
    with caplog.at_level(logging.WARNING):
        llm.add_lora(LoRARequest("renamed", 7, str(other)))
    assert "Llama-3-8B" in caplog.text and 7 in llm.list_loras()
    assert llm.remove_lora(7) and not llm.remove_lora(7)


def test_config_refusals(tiny: tuple[Path, Path, Path]) -> None:
    base, attn, _ = tiny
    with pytest.raises(ConfigError, match="speculative decoding is not supported with LoRA"):
        LLM(str(base), **ENGINE, speculative_config={"method": "ngram",
                                                     "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        LLM(str(base), **{**ENGINE, "max_cpu_loras": 1})
    plain = LLM(str(base), device="cpu", dtype="float32", num_kv_blocks=32)
    with pytest.raises(InvalidRequest, match="LoRA is not enabled"):
        plain.generate([[5, 6]], GREEDY, use_tqdm=False,
                       lora_request=LoRARequest("attn", 1, str(attn)))
