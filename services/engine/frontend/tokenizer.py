"""The Hugging Face tokenizer of a model, as the front ends load it (the core is handed one: it
detokenizes with it but never loads it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
