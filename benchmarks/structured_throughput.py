"""Structured outputs, offline on SmolLM2: the cost of guided decoding, same run.

A batch of chat requests generates a fixed number of tokens (ignore_eos) once free and once
guided by a JSON schema, so both do the same model work and only the grammar differs (a guided
row whose JSON is complete keeps being masked to EOS until max_tokens: the bitmask is filled and
applied on every step of every row). Runs alternate to even out a shared machine; the best of
each is kept. Also times a cold compile of each schema the tests use.
    .venv/bin/python -m benchmarks.structured_throughput [--num-requests 16] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5},
        "bio": {"type": "string", "maxLength": 400},
    },
    "required": ["name", "age", "city", "hobbies", "bio"],
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}


def compile_times(llm: object) -> dict[str, float]:
    """Milliseconds for a cold compile (fresh compiler, tokenizer info built beforehand)."""
    from shoal.services.gateway.openai.tools import ToolBody, required_schema
    from shoal.services.engine.sampling_params import StructuredOutputsParams
    from shoal.services.engine.structured_output.compiler import GrammarCompiler, tokenizer_info

    core = llm.engine  # type: ignore[attr-defined]
    info = tokenizer_info(core.tokenizer, core.runner.vocab_size, core.runner.eos_token_ids)
    tools = [ToolBody.model_validate({"type": "function", "function": {
        "name": f"tool_{i}", "parameters": WEATHER}}) for i in range(4)]
    specs = {"json_schema_person": StructuredOutputsParams(json=PERSON),
             "json_schema_weather": StructuredOutputsParams(json=WEATHER),
             "tool_choice_required_4_tools": StructuredOutputsParams(json=required_schema(tools)),
             "json_object": StructuredOutputsParams(json_object=True),
             "regex": StructuredOutputsParams(regex=r"The answer is [A-Z][a-z]+\."),
             "choice_3": StructuredOutputsParams(choice=["Paris", "Lyon", "Marseille"])}
    times = {}
    for name, spec in specs.items():
        compiler = GrammarCompiler(lambda: info)
        compiler.compile(StructuredOutputsParams(regex="x")).result()  # builds the compiler
        start = time.perf_counter()
        compiler.compile(spec).result()
        times[name] = (time.perf_counter() - start) * 1e3
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from shoal.services.engine.frontend.llm import LLM
    from shoal.services.engine.sampling_params import (SamplingParams,
                                                              StructuredOutputsParams)
    from shoal.services.engine.model_prep import smollm2_gguf_path

    llm = LLM(str(smollm2_gguf_path()), device="cpu", dtype="float32", num_threads=args.threads,
              max_num_seqs=args.num_requests, num_kv_blocks=64 * args.num_requests // 8)
    chats = [[{"role": "user", "content": f"Invent person number {i}; answer in JSON."}]
             for i in range(args.num_requests)]
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    guided = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    llm.chat(chats[:2], [free, guided], use_tqdm=False)  # warm-up; compiles the schema

    best = {"free": float("inf"), "json_schema": float("inf")}
    completed = 0
    for _ in range(args.repeats):
        for name, params in (("free", free), ("json_schema", guided)):
            start = time.perf_counter()
            outs = llm.chat(chats, params, use_tqdm=False)
            best[name] = min(best[name], time.perf_counter() - start)
            assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
            if name == "json_schema":
                completed = sum(_is_json(o.outputs[0].text) for o in outs)
    num_tokens = args.num_requests * args.max_tokens
    result = {
        "machine": platform.processor() or platform.machine(), "threads": args.threads,
        "num_requests": args.num_requests, "max_tokens": args.max_tokens,
        "free_tokens_per_s": num_tokens / best["free"],
        "json_schema_tokens_per_s": num_tokens / best["json_schema"],
        "ratio": best["free"] / best["json_schema"],
        "overhead_ms_per_step": (best["json_schema"] - best["free"]) / args.max_tokens * 1e3,
        "json_complete_within_max_tokens": completed,
        "compile_ms": compile_times(llm),
    }
    print(f"{num_tokens} tokens per run ({args.num_requests} requests x {args.max_tokens})")
    print(f"free        {result['free_tokens_per_s']:7.1f} tok/s")
    print(f"json schema {result['json_schema_tokens_per_s']:7.1f} tok/s   ratio "
          f"{result['ratio']:.3f}   +{result['overhead_ms_per_step']:.1f} ms per step "
          f"({completed}/{args.num_requests} JSON complete)")
    for name, ms in result["compile_ms"].items():
        print(f"compile {name:32s} {ms:7.1f} ms")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "structured_throughput.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()
