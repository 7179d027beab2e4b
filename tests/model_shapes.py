"""config.json shapes of real models, for the tests that size a model without its weights."""

from __future__ import annotations

QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_hidden_layers=48, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, vocab_size=151936,
                     tie_word_embeddings=False, max_position_embeddings=40960)
"""Qwen3-30B-A3B: 30.5B parameters, 3.3B of them active per token (8 of 128 experts)."""

GPT_OSS_20B = dict(architectures=["GptOssForCausalLM"], hidden_size=2880,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                   num_hidden_layers=24, intermediate_size=2880, num_local_experts=32,
                   num_experts_per_tok=4, vocab_size=201088, tie_word_embeddings=False,
                   max_position_embeddings=131072, sliding_window=128)
"""gpt-oss-20b: 20.9B parameters, 3.6B of them active per token (4 of 32 experts)."""
