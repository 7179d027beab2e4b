"""Quantised weights on the real SmolLM2-135M: the GGUF's Q4_1 blocks read as the gguf package
reads them, and a greedy chat answer that is still sane with each `quantization` (the answers
are not expected to equal fp32's token for token)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shoal.services.engine.config import ConfigError, EngineConfig
from shoal.services.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_q4_1_blocks_are_the_gguf_packages_dequantisation_exactly(gguf) -> None:
    import gguf as gguf_package

    from shoal.services.engine.layers.gguf_weights import q4_1_blocks

    reader = gguf_package.GGUFReader(gguf)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate.weight")
    assert tensor.tensor_type == gguf_package.GGMLQuantizationType.Q4_1
    cols, rows = (int(n) for n in tensor.shape[:2])
    codes, d, m = q4_1_blocks(tensor.data, rows, cols)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    ours = d.repeat_interleave(32, 1) * codes.float() + m.repeat_interleave(32, 1)
    theirs = gguf_package.quants.dequantize(tensor.data, tensor.tensor_type)
    np.testing.assert_array_equal(ours.numpy(), theirs.reshape(rows, cols).astype(np.float32))


@pytest.mark.parametrize("quantization", ["int8", "int4", "gguf"])
def test_greedy_chat_is_sane_with_each_quantization(gguf, quantization) -> None:
    from shoal.kernels import cpu_ops
    from shoal.services.engine.frontend.llm import LLM

    llm = LLM(gguf, device="cpu", dtype="float32", num_kv_blocks=64, num_threads=1,
              quantization=quantization)
    if quantization == "gguf":  # every Linear of the 30 layers from the file's own blocks,
        # the LM head (the tied embedding table, Q8_0 in this file) too
        # (packed for the int8-activation kernels where VNNI is built, torch's int4 elsewhere)
        q4_1 = "Q4_1" if cpu_ops.packed_available(3, 576) else "Q4_1 as int4"
        assert f"own blocks ({q4_1} x 120, Q8_0 x 1;" in llm.engine.runner.settings
    params = SamplingParams(temperature=0, max_tokens=16)
    outs = llm.chat([QUESTION, [{"role": "user", "content": "List three colours."}]] * 2,
                    params, use_tqdm=False)  # prefills of > 8 rows, decodes of 4: both kernels
    assert all("Paris" in o.outputs[0].text for o in outs[::2])
    assert all(len(o.outputs[0].text.split()) >= 3 for o in outs)


def test_a_gguf_runs_its_own_blocks_unless_none_is_asked(gguf) -> None:
    """The default for a .gguf model is its own blocks; quantization "none" is the fp32
    reference (the file dequantised), and a folder or several ranks keep their dtype."""
    from shoal.services.engine.frontend.llm import LLM
    from shoal.services.engine.layers.cpu_weights import resolve_quantization

    assert resolve_quantization(None, gguf, 1) == "gguf"
    assert resolve_quantization("none", gguf, 1) is None
    assert resolve_quantization(None, gguf, 2) is None
    assert resolve_quantization(None, str(Path(gguf).parent), 1) is None
    assert resolve_quantization("int8", gguf, 1) == "int8"
    for asked, runs in ((None, "the GGUF's own blocks"), ("none", "oneDNN packed weights")):
        llm = LLM(gguf, device="cpu", num_kv_blocks=16, num_threads=1, quantization=asked)
        assert f"matmuls: {runs}" in llm.engine.runner.settings
        out = llm.generate(["The capital of France is"], SamplingParams(temperature=0,
                                                                          max_tokens=4),
                           use_tqdm=False)
        assert "Paris" in out[0].outputs[0].text
        llm.shutdown()


def test_gguf_quantization_needs_a_gguf_file_on_one_rank(tmp_path) -> None:
    with pytest.raises(ConfigError) as refused:
        EngineConfig(model=str(tmp_path), quantization="gguf")
    assert refused.value.param == "quantization"
    with pytest.raises(ConfigError) as refused:
        EngineConfig(model="m.gguf", quantization="gguf", tensor_parallel_size=2)
    assert refused.value.param == "quantization"


def test_gguf_layers_are_the_converted_weights_in_int4(gguf) -> None:
    """Every Linear's Q4_1 blocks (q/k rows reordered, q/k/v and gate/up stacked) against the
    fp32 weights transformers converted from the same file: the check inside the extraction
    passes for all 120, and one layer's kernel (the packed Q4_1 blocks where AVX-512 VNNI is
    built, torch's int4 elsewhere) reproduces its fp32 matmul."""
    from transformers import AutoConfig

    from shoal.kernels import cpu_ops, select_ops
    from shoal.services.engine.layers.cpu_weights import Int4Linear
    from shoal.services.engine.layers.gguf_weights import (Q4_1, GGUFBlockLinear, GGUFSource,
                                                           _checked_parts, _kernel,
                                                           block_weight_names, open_source)
    from shoal.services.engine.runner.loader import load_weights
    from shoal.services.engine.model_prep import prepare_model
    from shoal.services.engine.models.registry import model_class

    folder = prepare_model(gguf)
    hf_config = AutoConfig.from_pretrained(folder)
    model = model_class(hf_config)(hf_config, 256, select_ops(torch.device("cpu")))
    load_weights(model, folder)
    blocks, dense = _checked_parts(model, Path(gguf))  # raises on a layer that differs
    assert len(blocks) == 4 * hf_config.num_hidden_layers + 1 and not dense  # + the LM head
    source = GGUFSource(Path(gguf))  # parsed once, for both steps of a blocks folder's start
    assert open_source(source) is source
    assert block_weight_names(model, source) == block_weight_names(model, Path(gguf))
    assert set(_checked_parts(model, source, check=False)[0]) == set(blocks)
    assert [t for t, _ in blocks["lm_head"]] == [8]  # Q8_0: the tied embedding table
    name = "model.layers.3.self_attn.qkv_proj"
    assert [t for t, _ in blocks[name]] == [Q4_1] * 3  # q, k and v, stacked
    layer = _kernel(model.get_submodule(name), blocks[name])
    packed = cpu_ops.packed_available(Q4_1, hf_config.hidden_size)
    assert isinstance(layer, GGUFBlockLinear if packed else Int4Linear)
    if packed:
        assert layer.packed == [True] and layer.rows == [ref_rows(hf_config)]  # one matmul
    x = torch.randn(1, hf_config.hidden_size)
    ref = torch.nn.functional.linear(x, model.get_submodule(name).weight)
    # the same weights; int8 (bf16) activations: 2 % of the output's range
    torch.testing.assert_close(layer(x), ref, atol=0.02 * ref.abs().max().item(), rtol=0.02)


def ref_rows(config) -> int:
    """q/k/v's output rows stacked."""
    head_dim = config.hidden_size // config.num_attention_heads
    return (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
