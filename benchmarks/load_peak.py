"""Peak RSS while building a model and loading its weights in bf16: built in the serving dtype
(`building_in`, as the engine does) against the old way (built in float32, loaded, then cast),
each in a fresh process, same run.

The model is a random-weight ~1B Llama (hidden 2048, 16 layers, 32 / 8 heads, FFN 8192, vocab
32000, tied), saved once as bf16 safetensors. The process's baseline RSS (torch imported) is
reported too; what loading adds is peak - baseline, against the weights' bytes. Peak RSS counts
the checkpoint's memory-mapped pages (clean, shared with the page cache) as well, so the peak of
anonymous memory (RssAnon, sampled every 5 ms) is reported beside it.

    .venv/bin/python -m benchmarks.load_peak [--layers 16] [--dir /tmp/load-peak-llama]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch


def save_model(folder: Path, layers: int) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=2048, tie_word_embeddings=True,
                      architectures=["LlamaForCausalLM"])
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(folder)
    kv = 8 * 64
    shapes = {"model.embed_tokens.weight": (32000, 2048), "model.norm.weight": (2048,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (2048, 2048),
                   p + "self_attn.k_proj.weight": (kv, 2048),
                   p + "self_attn.v_proj.weight": (kv, 2048),
                   p + "self_attn.o_proj.weight": (2048, 2048),
                   p + "mlp.gate_proj.weight": (8192, 2048), p + "mlp.up_proj.weight": (8192, 2048),
                   p + "mlp.down_proj.weight": (2048, 8192),
                   p + "input_layernorm.weight": (2048,),
                   p + "post_attention_layernorm.weight": (2048,)}
    gen = torch.Generator().manual_seed(0)
    save_file({k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
               for k, s in shapes.items()}, str(folder / "model.safetensors"))


def _rss_anon_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024 ** 2
    return 0.0


def measure(folder: Path, serving_dtype: bool) -> dict[str, float]:
    """Build + load in this (fresh) process; the peak RSS it reached, in GiB."""
    from transformers import AutoConfig

    from shoal.kernels import select_ops
    from shoal.services.engine.models.registry import model_class
    from shoal.services.engine.runner.loader import building_in, load_weights

    gib = 1024 ** 2  # ru_maxrss is in KiB
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / gib
    cfg, device, dtype = AutoConfig.from_pretrained(folder), torch.device("cpu"), torch.bfloat16
    ops = select_ops(device)
    anon, done = [_rss_anon_gib()], threading.Event()

    def sample() -> None:
        while not done.is_set():
            anon.append(_rss_anon_gib())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    if serving_dtype:
        with building_in(dtype, device):
            model = model_class(cfg)(cfg, 2048, ops)
    else:
        model = model_class(cfg)(cfg, 2048, ops)
    load_weights(model, folder)
    for param in model.parameters():
        param.data = param.data.to(device=device, dtype=dtype)
    done.set()
    sampler.join()
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 1024 ** 3
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / gib
    return {"baseline_gib": base, "peak_gib": peak, "added_gib": peak - base,
            "anon_peak_gib": max(anon), "anon_base_gib": anon[0], "weights_gib": weights}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/load-peak-llama"))
    parser.add_argument("--measure", choices=["serving", "float32-first"])
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.dir, args.measure == "serving")))
        return
    if not (args.dir / "model.safetensors").is_file():
        subprocess.run([sys.executable, "-c", "import sys; from benchmarks.load_peak import "
                        "save_model; from pathlib import Path; "
                        f"save_model(Path({str(args.dir)!r}), {args.layers})"], check=True)
    results = {}
    for mode in ("float32-first", "serving"):
        out = subprocess.run([sys.executable, "-m", "benchmarks.load_peak", "--dir",
                              str(args.dir), "--measure", mode],
                             check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
        r = results[mode]
        print(f"{mode:>14}: peak RSS {r['peak_gib']:.2f} GiB (baseline {r['baseline_gib']:.2f}, "
              f"loading added {r['added_gib']:.2f}; anonymous peak {r['anon_peak_gib']:.2f}, "
              f"baseline {r['anon_base_gib']:.2f}; weights {r['weights_gib']:.2f} GiB bf16)")
    ratio = results["serving"]["added_gib"] / results["float32-first"]["added_gib"]
    print(f"added by loading, serving dtype / float32-first: {ratio:.2f}")


if __name__ == "__main__":
    main()
