"""Engine part of the GPU benchmark: a Llama-3-8B-shaped checkpoint with random bf16 weights (made
here, with a word-level tokenizer), batch-1 decode tokens/s against the memory-bandwidth bound,
and throughput at 64 and 256 concurrent sequences (fixed lengths, ignore_eos) against
transformers' generate on the same GPU. `smoke` uses a tiny model on the CPU."""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

LLAMA3_8B: dict[str, Any] = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    architectures=["LlamaForCausalLM"])
TINY: dict[str, Any] = {**LLAMA3_8B, "hidden_size": 64, "intermediate_size": 128,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "vocab_size": 512, "max_position_embeddings": 1024}
PROMPT_LEN, OUTPUT_LEN = 128, 128


def make_checkpoint(folder: Path, kwargs: dict[str, Any], device: torch.device) -> dict[str, int]:
    """config.json, one safetensors shard per layer (random, std 0.02), a word-level tokenizer.
    Returns the bytes one decode step must read (every weight but the embedding) and the total."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    cfg = LlamaConfig(**kwargs)
    cfg.save_pretrained(folder)
    h, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    head_dim = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head_dim
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    sizes = {"total": 0, "embedding": vocab * h * 2}
    shards: list[dict[str, torch.Tensor]] = [{"model.embed_tokens.weight": rand(vocab, h),
                                              "lm_head.weight": rand(vocab, h),
                                              "model.norm.weight": ones(h)}]
    for i in range(cfg.num_hidden_layers):
        shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h),
                  "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, h),
                  "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                  "mlp.down_proj": (h, inter)}
        shard = {f"model.layers.{i}.{name}.weight": rand(*shape) for name, shape in shapes.items()}
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shard[f"model.layers.{i}.{norm}.weight"] = ones(h)
        shards.append(shard)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        sizes["total"] += sum(t.numel() * 2 for t in shard.values())
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": sizes["total"]}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    word = models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")
    tok = Tokenizer(word)
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(folder)
    return {"weights_bytes": sizes["total"],
            "decode_step_bytes": sizes["total"] - sizes["embedding"]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _prompts(num: int, vocab: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(num)
    return torch.randint(3, vocab, (num, length), generator=gen).tolist()


def _lengths(smoke: bool) -> tuple[int, int]:
    return (8, 8) if smoke else (PROMPT_LEN, OUTPUT_LEN)


def shoal_runs(folder: Path, vocab: int, device: torch.device, smoke: bool) -> dict[str, Any]:
    from shoal.services.engine import LLM, SamplingParams

    prompt_len, output_len = _lengths(smoke)

    args: dict[str, Any] = {"max_num_seqs": 256, "max_model_len": 4096 if not smoke else 512}
    if smoke:
        args.update(kv_cache_memory=64 << 20, max_num_seqs=16)
    llm = LLM(str(folder), **args)

    def timed(prompts: list[list[int]], num_out: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=num_out, ignore_eos=True)
        _sync(device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        _sync(device)
        assert all(len(o.outputs[0].token_ids) == num_out for o in outs)
        return time.perf_counter() - start

    one = _prompts(1, vocab, prompt_len)
    timed(one, 8)  # warm-up
    t_first, t_all = timed(one, 1), timed(one, output_len + 1)
    result: dict[str, Any] = {"batch1_decode_tok/s": output_len / (t_all - t_first)}
    for num in ([4, 16] if smoke else [64, 256]):
        seconds = timed(_prompts(num, vocab, prompt_len), output_len)
        result[f"throughput_{num}_output_tok/s"] = num * output_len / seconds
    result = {k: round(v, 1) for k, v in result.items()}
    result["num_kv_blocks"] = llm.engine.runner.num_kv_blocks
    llm = None  # frees the engine's memory before the next run (not `del`: timed() uses it)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def transformers_runs(folder: Path, vocab: int, device: torch.device, smoke: bool
                      ) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if smoke else torch.bfloat16
    prompt_len, output_len = _lengths(smoke)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0

    def timed(prompts: list[list[int]], num_out: int) -> float:
        ids = torch.tensor(prompts, device=device)
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=num_out, min_new_tokens=num_out,
                                 do_sample=False)
        _sync(device)
        assert out.shape[1] == ids.shape[1] + num_out
        return time.perf_counter() - start

    one = _prompts(1, vocab, prompt_len)
    timed(one, 8)
    t_first, t_all = timed(one, 1), timed(one, output_len + 1)
    result: dict[str, Any] = {"batch1_decode_tok/s": output_len / (t_all - t_first)}
    for num in ([4, 16] if smoke else [64, 256]):
        result[f"throughput_{num}_output_tok/s"] = num * output_len / timed(
            _prompts(num, vocab, prompt_len), output_len)
    result = {k: round(v, 1) for k, v in result.items()}
    model = None  # frees the model's memory before the next run (not `del`: timed() uses it)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def engine_benchmarks(device: torch.device, bandwidth: float, smoke: bool,
                      with_transformers: bool) -> dict[str, Any]:
    kwargs = TINY if smoke else LLAMA3_8B
    with tempfile.TemporaryDirectory(prefix="shoal-llama3-8b-") as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        sizes = make_checkpoint(folder, kwargs, device)
        result: dict[str, Any] = {"model": "Llama-3-8B shape, random bf16" if not smoke else "tiny",
                                  **sizes, "checkpoint_s": round(time.perf_counter() - start, 1)}
        bound = bandwidth / sizes["decode_step_bytes"]
        result["batch1_decode_bound_tok/s"] = round(bound, 1)
        result["shoal"] = shoal_runs(folder, kwargs["vocab_size"], device, smoke)
        result["shoal"]["batch1_fraction_of_bound"] = round(
            result["shoal"]["batch1_decode_tok/s"] / bound, 3)
        if with_transformers:
            result["transformers"] = transformers_runs(folder, kwargs["vocab_size"], device, smoke)
    return result
