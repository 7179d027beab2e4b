"""Tiny random-weight Llama / Mistral / Qwen2 / Qwen3 checkpoints for fast parity tests, the
mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, gpt-oss) and the dense
families with their own twists (Gemma 2, Gemma 3, Phi-3, Granite) at the same width; gpt-oss's
MXFP4 layout written from a tiny model (`save_gpt_oss_mxfp4`).

Each is saved with save_pretrained (fp32 safetensors) plus SmolLM2's tokenizer files (the tiny
vocabulary is a prefix of it), so the engine loads it exactly as it loads a real model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GptOssConfig,
                          GraniteConfig, LlamaConfig, MistralConfig, MixtralConfig, OlmoeConfig,
                          Phi3Config, PretrainedConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
                          Qwen3MoeConfig)

MOE_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss"]
DENSE_EXTRA_ARCHS = ["gemma2", "gemma3", "phi3", "granite"]
ARCHS = ["llama", "mistral", "qwen2", "qwen3", *MOE_ARCHS, *DENSE_EXTRA_ARCHS]
VOCAB = 512
ENGINE_ARGS: dict[str, dict[str, int]] = {"phi3": {"max_model_len": 64}}
"""Engine settings a family's parity runs need: Phi-3's LongRoPE takes its short factors only
when the engine's context fits the original 64 positions (transformers': every prompt here is
shorter); tests/parity/test_dense_families_parity.py runs the long factors."""


def engine_args(arch: str) -> dict[str, int]:
    return dict(ENGINE_ARGS.get(arch, {}))

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2,
               initializer_range=0.2, rms_norm_eps=1e-6)


def tiny_config(arch: str) -> PretrainedConfig:
    if arch == "llama":  # untied, llama3 rope scaling, biased attention
        return LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=False, attention_bias=True,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                            "factor": 4.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64})
    if arch == "mistral":  # one KV head (GQA 4:1), untied
        return MistralConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=1,
                             tie_word_embeddings=False, sliding_window=None)
    if arch == "qwen2":  # q/k/v bias, tied, linear rope scaling
        return Qwen2Config(**_COMMON, num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=True,
                           rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                            "factor": 2.0})
    if arch == "qwen3":  # q/k norms, head_dim (32) != hidden / heads (16), tied
        return Qwen3Config(**_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           tie_word_embeddings=True)
    if arch == "qwen3_moe":  # 8 experts top-2 renormalised; layer 1 dense (mlp_only_layers)
        return Qwen3MoeConfig(**{**_COMMON, "num_hidden_layers": 3}, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
    if arch == "qwen2_moe":  # a shared expert and its gate, top-k not renormalised, tied
        return Qwen2MoeConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2,
                              tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=64, shared_expert_intermediate_size=96,
                              norm_topk_prob=False, decoder_sparse_step=1)
    if arch == "mixtral":  # 4 experts of intermediate_size each, top-2, one KV head
        return MixtralConfig(**{**_COMMON, "intermediate_size": 64}, num_attention_heads=4,
                             num_key_value_heads=1, tie_word_embeddings=False,
                             num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    if arch == "olmoe":  # q/k norms over the whole projection (GQA 2:1), top-k as routed
        return OlmoeConfig(**{**_COMMON, "intermediate_size": 64}, num_attention_heads=4,
                           num_key_value_heads=2, tie_word_embeddings=False, num_experts=4,
                           num_experts_per_tok=2, norm_topk_prob=False)
    if arch == "gpt_oss":  # sinks, window 16 on layer 0, YaRN, a SwiGLU limit low enough to bite
        return GptOssConfig(**{**_COMMON, "intermediate_size": 64, "max_position_embeddings": 256},
                            num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                            num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                            swiglu_limit=2.0, attention_bias=True,
                            layer_types=["sliding_attention", "full_attention"],
                            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                             "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                             "truncate": False,
                                             "original_max_position_embeddings": 64})
    if arch == "gemma2":  # soft-caps small enough to bite, window 16 on even layers, tied
        return Gemma2Config(**_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            query_pre_attn_scalar=24, sliding_window=16,
                            attn_logit_softcapping=1.5, final_logit_softcapping=4.0,
                            layer_types=["sliding_attention", "full_attention"])
    if arch == "gemma3":  # q/k norms, per-layer-type rope (linear on the full layers)
        return Gemma3TextConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=1,
                                head_dim=32, query_pre_attn_scalar=16, sliding_window=16,
                                layer_types=["sliding_attention", "full_attention"],
                                final_logit_softcapping=None, attn_logit_softcapping=None,
                                rope_parameters={
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 1000000.0}})
    if arch == "phi3":  # LongRoPE from 64 original positions, partial rotary (Phi-4-mini), untied
        return Phi3Config(**{**_COMMON, "pad_token_id": 0}, num_attention_heads=4,
                          num_key_value_heads=2, tie_word_embeddings=False,
                          partial_rotary_factor=0.75, original_max_position_embeddings=64,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.75,
                                           "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                           "long_factor": [1.0 + 2.0 * i for i in range(6)]})
    if arch == "granite":  # every multiplier away from 1
        return GraniteConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=True, embedding_multiplier=1.8,
                             attention_multiplier=0.1, residual_multiplier=0.4,
                             logits_scaling=2.5)
    raise ValueError(arch)


def smollm2_dir() -> Path:
    from shoal.services.engine.model_prep import prepare_model, smollm2_gguf_path

    return prepare_model(str(smollm2_gguf_path()))


def tokenizer_dir() -> Path:
    """SmolLM2's tokenizer files: SHOAL_TEST_TOKENIZER_DIR when set (a machine with torch but not
    the GGUF package, such as a lent GPU machine: benchmarks/device/), else the converted GGUF."""
    if folder := os.environ.get("SHOAL_TEST_TOKENIZER_DIR"):
        return Path(folder)
    return smollm2_dir()


def save_tiny_model(arch: str, folder: Path, seed: int = 0, **config: object) -> Path:
    """`config`: attributes set on tiny_config(arch) first (e.g. mlp_only_layers=[])."""
    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    for key, value in config.items():
        setattr(cfg, key, value)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms at 1.0 would hide a mis-loaded weight: randomise them too
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
        if arch.startswith("gemma"):  # x sqrt(hidden) would drown the layers: greedy repeats
            model.get_input_embeddings().weight.mul_(0.2)
        if arch == "gpt_oss":  # biases and sinks start at zero: make them count
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0.0, 0.5)
                elif name.endswith("sinks"):
                    param.uniform_(-1.0, 3.0)
    model.save_pretrained(folder)
    source = tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return folder


def with_config(folder: Path, dest: Path, **overrides: object) -> Path:
    """A copy of a saved tiny model whose config.json has `overrides` (e.g. a sliding window):
    the same weights under another attention setting."""
    shutil.copytree(folder, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(overrides)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def mxfp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] -> (blocks [..., rows, cols / 32, 16] uint8, scales [..., rows, cols /
    32] uint8), as OpenAI's gpt-oss checkpoints store them: the nearest E2M1 code of each value
    under its block's power-of-two scale (the block's largest magnitude brought to <= 6), two
    codes a byte, the low nibble first; the scale's exponent biased by 127."""
    from shoal.services.engine.layers.mxfp4 import FP4_E2M1

    *lead, cols = weight.shape
    groups = weight.float().reshape(*lead, cols // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0 ** -100)
    exponents = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / torch.exp2(exponents).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - torch.tensor(FP4_E2M1)).abs().argmin(-1).to(torch.uint8)
    pairs = codes.reshape(*lead, cols // 32, 16, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), (exponents + 127).to(torch.uint8).contiguous()


def save_gpt_oss_mxfp4(folder: Path, dense: Path, packed: Path) -> tuple[Path, Path]:
    """From a saved tiny gpt-oss: `dense`, its experts rounded to MXFP4 values (the bf16
    layout), and `packed`, the same experts as MXFP4 `_blocks` / `_scales` with the config's
    quantization_config, as OpenAI ships gpt-oss: the two hold the same model."""
    from safetensors.torch import load_file, save_file

    from shoal.services.engine.layers.mxfp4 import dequantize

    shutil.copytree(folder, dense)
    shutil.copytree(folder, packed)
    tensors = load_file(folder / "model.safetensors")
    rounded, blocks_and_scales = dict(tensors), {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out]
            blocks, scales = mxfp4_quantize(tensor.transpose(1, 2))  # rows = outputs
            rounded[name] = dequantize(blocks, scales).transpose(1, 2).contiguous()
            blocks_and_scales[f"{name}_blocks"], blocks_and_scales[f"{name}_scales"] = (
                blocks, scales)
        else:
            blocks_and_scales[name] = tensor
    save_file(rounded, dense / "model.safetensors", metadata={"format": "pt"})
    save_file(blocks_and_scales, packed / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (packed / "config.json").write_text(json.dumps(config))
    return dense, packed


def save_tiny_cross_encoder(folder: Path, seed: int = 0) -> Path:
    """A random BertForSequenceClassification with one label (a cross-encoder: /v1/score and
    /v1/rerank) over all-MiniLM-L6-v2's tokenizer, initialised wide (0.3) so that scores spread over
    (0, 1) and parity checks see differences."""
    from transformers import BertConfig, BertForSequenceClassification

    from shoal.services.engine.model_prep import minilm_path

    torch.manual_seed(seed)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=512, num_labels=1,
        initializer_range=0.3))
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json"):
        if (minilm_path() / name).is_file():
            shutil.copy(minilm_path() / name, folder / name)
    return folder


def save_tiny_decoder_embedder(folder: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3 saved as Qwen3-Embedding is: the causal LM's folder plus
    sentence-transformers' modules.json (Transformer -> last-token Pooling -> Normalize), over
    SmolLM2's whole vocabulary so that any text tokenizes to ids the model has."""
    from transformers import AutoTokenizer

    save_tiny_model("qwen3", folder, seed, vocab_size=49152)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if tokenizer.pad_token is None:  # sentence-transformers pads its batches
        tokenizer.pad_token = tokenizer.eos_token
        tokenizer.save_pretrained(str(folder))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256}))
    return folder


def save_tiny_xlm_roberta_cross_encoder(folder: Path, seed: int = 0) -> Path:
    """A random XLMRobertaForSequenceClassification with one label (bge-reranker's architecture)
    and a tokenizer laid out as XLM-RoBERTa's: <s>=0, <pad>=1, </s>=2, <unk>=3, pairs as
    `<s> a </s></s> b </s>`, no token types (all-MiniLM-L6-v2's word pieces stand in for
    XLM-R's SentencePiece vocabulary, which no offline package ships)."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece
    from transformers import (PreTrainedTokenizerFast, XLMRobertaConfig,
                              XLMRobertaForSequenceClassification)

    from shoal.services.engine.model_prep import minilm_path

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    words = [w for w in (minilm_path() / "vocab.txt").read_text().splitlines()
             if w and not w.startswith("[")]
    vocab = {w: i for i, w in enumerate([*specials, *words])}
    tok = Tokenizer(WordPiece(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   sep_token="</s>", cls_token="<s>", pad_token="<pad>",
                                   unk_token="<unk>", mask_token="<mask>",
                                   model_input_names=["input_ids", "attention_mask"])
    fast.save_pretrained(str(folder))
    torch.manual_seed(seed)
    model = XLMRobertaForSequenceClassification(XLMRobertaConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, num_labels=1, initializer_range=0.3))
    model.save_pretrained(folder, safe_serialization=True)
    return folder
