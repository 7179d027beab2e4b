"""GGUF files as users have them (Q8_0, Q4_K_M, Q5_K_M, Q6_K), each running its own blocks
(`quantization="gguf"`, a .gguf's default) against the fp32 reference, same process, same run.

The files: the bundled SmolLM2-135M Q4_1 GGUF dequantised into an F32 GGUF (the reference: its
weights are what fp32 runs), then quantised by llama.cpp's own quantizer (`llama_model_quantize`
of the llama-cpp-python that `make peer-llamacpp` builds, in a child process of that venv). Without
that venv only Q8_0 is made, by the gguf package's quantizer. SmolLM2's hidden size (576) is no
multiple of 256, so llama.cpp stores the tensors that read it in its fallback types (Q5_0, Q5_1,
Q8_0) even in a K-quant file; the start line's `matmuls:` (printed) says which types each ran.

- quality: perplexity on quant_quality.py's text, and greedy agreement over its 16 chat prompts
  x 64 tokens (sequences identical to fp32's, mean common prefix)
- decode: single stream, one chat prompt, 128 tokens forced, tok/s, the median of `--rounds`
  alternating rounds; fp32, bf16 (the same F32 file, dtype bfloat16) and each file, and
  llama.cpp on each file in the same rounds where its venv is built
- prefill: the text as one prompt (one output token), prompt tok/s, against bf16's
Every figure is printed as a ratio to fp32 (and to bf16, llama.cpp) of the same run.
    .venv/bin/python -m benchmarks.gguf_quant [--types Q8_0,Q4_K_M,Q5_K_M,Q6_K] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.offline_throughput import RESULTS
from benchmarks.peer_llamacpp import PEER_PYTHON, LlamaCppPeer
from benchmarks.quant_quality import TEXT, greedy, perplexity

WORK = RESULTS / "gguf_quant"
PEER_READY = PEER_PYTHON.parents[1] / ".peer-installed"
"""`make peer-llamacpp`'s stamp: the venv exists before llama-cpp-python is built into it."""
QUANTIZE = """
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
params.nthread = int(sys.argv[4])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(),
                                        ctypes.byref(params)))
"""


def copy_metadata(reader: Any, writer: Any) -> None:
    """Every key of `reader` but the ones the writer sets itself (architecture, file type)."""
    import gguf

    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)


def write_f32(source: Path, dest: Path) -> Path:
    """`source` with every tensor dequantised to F32, its metadata as it is."""
    import gguf

    if dest.is_file():
        return dest
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dest) + ".tmp", arch)
    copy_metadata(reader, writer)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        writer.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(dest) + ".tmp").rename(dest)
    return dest


def quantize_q8_0(f32: Path, dest: Path) -> None:
    """The gguf package's Q8_0 for every 2-D weight (norms stay F32), where llama.cpp is not
    built."""
    import gguf

    reader = gguf.GGUFReader(str(f32))
    writer = gguf.GGUFWriter(str(dest) + ".tmp", reader.fields["general.architecture"].contents())
    copy_metadata(reader, writer)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        data = np.asarray(t.data, dtype=np.float32).reshape(shape)
        if data.ndim == 2 and data.shape[-1] % 32 == 0:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(t.name, q, raw_shape=q.shape,
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(dest) + ".tmp").rename(dest)


def make_file(f32: Path, kind: str, threads: int) -> Path | None:
    dest = f32.with_name(f32.name.replace("F32", kind))
    if dest.is_file():
        return dest
    if PEER_READY.exists():
        subprocess.run([str(PEER_PYTHON), "-c", QUANTIZE, str(f32), str(dest), kind,
                        str(threads)], check=True, capture_output=True)
        return dest
    if kind == "Q8_0":
        quantize_q8_0(f32, dest)
        return dest
    print(f"{kind}: skipped (no llama.cpp quantizer: `make peer-llamacpp` builds it)")
    return None


def decode_tok_s(llm: Any, prompt: list[int], tokens: int) -> float:
    from shoal.services.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return tokens / (time.perf_counter() - start)


def prefill_tok_s(llm: Any, ids: list[int]) -> float:
    from shoal.services.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    start = time.perf_counter()
    llm.generate([ids], params, use_tqdm=False)
    return len(ids) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", default="Q8_0,Q4_K_M,Q5_K_M,Q6_K")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp peer")
    args = parser.parse_args()
    from shoal.services.engine import LLM, smollm2_gguf_path
    from shoal.services.engine.runner.cpu_threads import default_cpu_threads

    threads = args.threads or default_cpu_threads()
    WORK.mkdir(parents=True, exist_ok=True)
    f32 = write_f32(smollm2_gguf_path(), WORK / "SmolLM2-135M-Instruct.F32.gguf")
    files = {kind: path for kind in args.types.split(",")
             if (path := make_file(f32, kind.strip(), threads)) is not None}

    def engine(path: Path, **kw: Any) -> Any:
        return LLM(str(path), device="cpu", num_threads=threads, kv_cache_memory=128 * 2**20,
                   enable_prefix_caching=False, **kw)  # every prefill computed, every round

    llms = {"fp32": engine(f32, quantization="none"),
            "bf16": engine(f32, quantization="none", dtype="bfloat16")}
    llms |= {kind: engine(path) for kind, path in files.items()}  # the default: own blocks
    tokenizer = llms["fp32"].get_tokenizer()
    ids = tokenizer.encode(TEXT)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Explain photosynthesis in two sentences."}],
        add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    result: dict[str, Any] = {"threads": threads, "tokens": args.tokens, "engines": {}}
    print(f"loaded: {', '.join(llms)}; quality...", flush=True)
    ref_tokens = greedy(llms["fp32"])
    for name, llm in llms.items():
        row = result["engines"][name] = {"settings": llm.engine.runner.settings,
                                         "perplexity": perplexity(llm, ids)}
        if name != "fp32":
            quant = greedy(llm)
            pairs = list(zip(ref_tokens, quant, strict=True))
            row["identical"] = sum(r == q for r, q in pairs)
            row["mean_common_prefix"] = float(np.mean([next(
                (i for i, (a, b) in enumerate(zip(r, q, strict=True)) if a != b), len(r))
                for r, q in pairs]))
    peers = {}
    if PEER_READY.exists() and not args.no_llamacpp:
        peers = {kind: LlamaCppPeer(str(path), threads) for kind, path in files.items()}
    decode: dict[str, list[float]] = {name: [] for name in [*llms, *(f"llama.cpp {k}"
                                                                   for k in peers)]}
    prefill: dict[str, list[float]] = {name: [] for name in llms}
    print("speed...", flush=True)
    try:
        for _ in range(args.rounds):  # alternating
            for name, llm in llms.items():
                decode[name].append(decode_tok_s(llm, prompt, args.tokens))
                prefill[name].append(prefill_tok_s(llm, ids))
                if name in peers:
                    seconds = peers[name].run(prompt, args.tokens)
                    decode[f"llama.cpp {name}"].append(args.tokens / seconds)
    finally:
        for peer in peers.values():
            peer.close()
    med = {name: statistics.median(v) for name, v in decode.items()}
    pre = {name: statistics.median(v) for name, v in prefill.items()}
    print(f"SmolLM2-135M, {threads} thread(s), decode: {args.tokens} tokens forced, median of "
          f"{args.rounds} rounds; prefill: {len(ids)} prompt tokens")
    for name, row in result["engines"].items():
        row |= {"decode_tok_s": med[name], "decode_runs": decode[name],
                "prefill_tok_s": pre[name], "prefill_runs": prefill[name]}
        ppl = row["perplexity"] / result["engines"]["fp32"]["perplexity"]
        line = (f"{name:7s} ppl {row['perplexity']:7.3f} ({ppl:.3f}x fp32)  decode "
                f"{med[name]:6.1f} tok/s "
                f"({med[name] / med['fp32']:.2f}x fp32, {med[name] / med['bf16']:.2f}x bf16")
        if f"llama.cpp {name}" in med:
            peer = med[f"llama.cpp {name}"]
            row["llamacpp_decode_tok_s"] = peer
            line += f", {med[name] / peer:.2f}x llama.cpp's {peer:.1f}"
        line += (f")  prefill {pre[name]:6.0f} tok/s ({pre[name] / pre['bf16']:.2f}x bf16)")
        if "identical" in row:
            line += (f"  greedy: {row['identical']}/16 identical to fp32, common prefix "
                     f"{row['mean_common_prefix']:.1f}/64")
        print(line)
        print(f"        {row['settings'].split('matmuls: ')[-1]}")
    path = RESULTS / f"gguf_quant-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"written {path}")


if __name__ == "__main__":
    main()
