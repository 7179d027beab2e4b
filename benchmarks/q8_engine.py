"""The int8-activation kernels in the engine: SmolLM2-135M single-stream decode with them and
with the kernels they replaced, same process, alternating rounds, and greedy agreement with fp32.

Engines: the bundled Q4_1 GGUF (its Q4_1 layers run torch's int4 kernel either way; its Q8_0
LM head is a block layer), a Q8_0 GGUF (benchmarks/gguf_quant.py makes it), and Shoal's `int8`
of the fp32 weights. Each engine's block / int8 layers are switched between "prior" (`q8` off:
the float block matmul, `torch._weight_int8pack_mm`) and "new" (as shipped; with `--q8-everywhere`
Q8_0 below MANY_ROWS too) between rounds. Greedy: `--prompts` chat questions one at a time
(single-stream steps, where the kernels run), `--greedy-tokens` each, sequences identical to
fp32's (the same file dequantised) and the mean common prefix.

    .venv/bin/python -m benchmarks.q8_engine [--rounds 5] [--tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import numpy as np

from benchmarks.gguf_quant import WORK, decode_tok_s, make_file, write_f32
from benchmarks.quant_quality import QUESTIONS


def set_q8(llm: Any, on: bool) -> int:
    """Switch every int8-capable kernel of `llm`'s model; returns how many."""
    from shoal.kernels import cpu_ops

    count = 0
    for module in llm.engine.runner.model.modules():
        kernel = getattr(module, "kernel", None)
        if hasattr(kernel, "q8"):
            kernel.q8 = on and cpu_ops.q8_available(kernel_in_features(kernel))
            count += 1
    return count


def kernel_in_features(kernel: Any) -> int:
    return int(getattr(kernel, "in_features", 0) or kernel.qweight.shape[1])


def greedy_one_at_a_time(llm: Any, prompts: int, tokens: int) -> list[list[int]]:
    from shoal.services.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [list(llm.chat([[{"role": "user", "content": q}]], params,
                          use_tqdm=False)[0].outputs[0].token_ids) for q in QUESTIONS[:prompts]]


def agreement(ref: list[list[int]], got: list[list[int]]) -> str:
    same = sum(r == g for r, g in zip(ref, got, strict=True))
    prefix = np.mean([next((i for i, (a, b) in enumerate(zip(r, g, strict=True)) if a != b),
                           len(r)) for r, g in zip(ref, got, strict=True)])
    return f"{same}/{len(ref)} identical to fp32, common prefix {prefix:.1f}/{len(ref[0])}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--q8-everywhere", action="store_true")
    args = parser.parse_args()
    from shoal.services.engine import LLM, smollm2_gguf_path
    from shoal.services.engine.layers import gguf_weights
    from shoal.services.engine.runner.cpu_threads import default_cpu_threads

    if args.q8_everywhere:
        gguf_weights.FLOAT_FEW_ROWS.clear()
    threads = args.threads or default_cpu_threads()
    WORK.mkdir(parents=True, exist_ok=True)
    f32 = write_f32(smollm2_gguf_path(), WORK / "SmolLM2-135M-Instruct.F32.gguf")
    q8_0 = make_file(f32, "Q8_0", threads)

    def engine(path: Any, **kw: Any) -> Any:
        return LLM(str(path), device="cpu", num_threads=threads, kv_cache_memory=128 * 2**20,
                   enable_prefix_caching=False, **kw)

    llms = {"Q4_1 GGUF": engine(smollm2_gguf_path()), "Q8_0 GGUF": engine(q8_0),
            "int8": engine(f32, quantization="int8")}
    reference = engine(f32, quantization="none")
    tokenizer = reference.get_tokenizer()
    prompt = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Explain photosynthesis in two sentences."}],
        add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    ref = greedy_one_at_a_time(reference, args.prompts, args.greedy_tokens)
    del reference
    for name, llm in llms.items():
        print(f"{name}: {set_q8(llm, True)} switchable layers; "
              f"{llm.engine.runner.settings.split('matmuls: ')[-1][:160]}", flush=True)
        for mode in (False, True):
            set_q8(llm, mode)
            got = greedy_one_at_a_time(llm, args.prompts, args.greedy_tokens)
            print(f"  greedy {'new' if mode else 'prior'}: {agreement(ref, got)}", flush=True)
    runs: dict[tuple[str, bool], list[float]] = {(n, m): [] for n in llms for m in (False, True)}
    for _ in range(args.rounds):  # alternating: engine, then prior / new
        for name, llm in llms.items():
            for mode in (False, True):
                set_q8(llm, mode)
                runs[(name, mode)].append(decode_tok_s(llm, prompt, args.tokens))
    print(f"single-stream decode, {args.tokens} tokens forced, {threads} threads, median of "
          f"{args.rounds} alternating rounds")
    for name in llms:
        prior, new = (statistics.median(runs[(name, m)]) for m in (False, True))
        print(f"{name:10s} prior {prior:6.1f} tok/s  new {new:6.1f} tok/s  {new / prior:.2f}x")


if __name__ == "__main__":
    main()
