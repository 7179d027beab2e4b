"""The pure rules of tensor / pipeline parallelism: which tp sizes split a model (SmolLM2's 9
query and 3 KV heads: 3 does, 2 does not), the KV heads each rank holds, layer ranges per stage,
cores per rank. No process group here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shoal.services.engine.config import ConfigError, EngineConfig
from shoal.services.engine.distributed.launch import core_shares
from shoal.services.engine.distributed.parallel_state import (
    check_parallel_shapes, kv_heads_per_rank, stage_layers
)

SMOLLM2 = SimpleNamespace(architectures=["LlamaForCausalLM"], num_attention_heads=9,
                          num_key_value_heads=3, intermediate_size=1536, num_hidden_layers=30)


def test_smollm2_splits_in_three_and_refuses_two_with_the_reason() -> None:
    check_parallel_shapes(SMOLLM2, 3, 1)
    with pytest.raises(ConfigError) as err:
        check_parallel_shapes(SMOLLM2, 2, 1)
    assert "9 attention heads" in err.value.message and "3 KV heads" in err.value.message
    assert "sizes that work: 1, 3" in err.value.message
    assert err.value.param == "tensor_parallel_size"


def test_an_moe_splits_only_where_every_expert_and_the_shared_one_split() -> None:
    moe = dict(architectures=["Qwen2MoeForCausalLM"], num_attention_heads=8,
               num_key_value_heads=4, intermediate_size=512, num_hidden_layers=2)
    check_parallel_shapes(SimpleNamespace(**moe, moe_intermediate_size=96,
                                          shared_expert_intermediate_size=36), 4, 1)
    with pytest.raises(ConfigError, match="MLP size 4"):  # 8 splits 512 and 96, not 36: gcd 4
        check_parallel_shapes(SimpleNamespace(**moe, moe_intermediate_size=96,
                                              shared_expert_intermediate_size=36), 8, 1)
    with pytest.raises(ConfigError, match="sizes that work: 1, 2"):  # experts 1406: 2 only
        check_parallel_shapes(SimpleNamespace(**moe, moe_intermediate_size=1406), 4, 1)


def test_kv_heads_are_split_or_replicated() -> None:
    gqa = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, intermediate_size=64,
                          num_hidden_layers=4)
    check_parallel_shapes(gqa, 4, 1)  # 4 > 2 KV heads, a multiple: replicated
    assert [kv_heads_per_rank(2, tp) for tp in (1, 2, 4, 8)] == [2, 1, 1, 1]
    with pytest.raises(ConfigError, match="MLP size 64"):
        check_parallel_shapes(SimpleNamespace(num_attention_heads=6, num_key_value_heads=6,
                                              intermediate_size=64, num_hidden_layers=4), 3, 1)
    with pytest.raises(ConfigError, match="KV heads"):  # 3 ranks cannot share 2 KV heads
        check_parallel_shapes(SimpleNamespace(num_attention_heads=6, num_key_value_heads=2,
                                              intermediate_size=66, num_hidden_layers=4), 3, 1)


def test_stage_layers_are_contiguous_and_cover_every_layer() -> None:
    for layers, pp in [(30, 2), (30, 4), (2, 2), (7, 3)]:
        ranges = [stage_layers(layers, pp, r) for r in range(pp)]
        assert ranges[0][0] == 0 and ranges[-1][1] == layers
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= 1
    assert stage_layers(7, 3, 0) == (0, 3)
    with pytest.raises(ConfigError, match="exceeds the 30 layers"):
        check_parallel_shapes(SMOLLM2, 1, 31)


def test_core_shares_split_the_cores() -> None:
    assert core_shares([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert core_shares([0, 1], 2) == [[0], [1]]
    assert core_shares([0, 1], 3) == [[0], [1], [0]]  # more ranks than cores: one each


def test_engine_config_refuses_a_zero_size_and_speculation_across_ranks() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig(model="m", tensor_parallel_size=0)
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    with pytest.raises(ConfigError, match="runs on one rank") as err:
        EngineConfig(model="m", pipeline_parallel_size=2, speculative_config=ngram)
    assert err.value.param == "speculative_config"
