"""Random LoRA adapters made with PEFT for the tiny models (and SmolLM2), and PEFT's own
greedy reference for each: the ground truth the engine's batched LoRA is compared with.

init_lora_weights=False draws B at random too (PEFT's default zeroes it), so every adapter
changes the model's output.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(base: Path, dest: Path, *, targets: list[str], r: int = 8, alpha: int = 16,
                 seed: int = 0, scale: float = 1.0, **config: object) -> Path:
    """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) over `base`;
    scale shrinks the random weights (a delta as large as the weights swamps the model)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                      init_lora_weights=False, **config)  # type: ignore[arg-type]
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.mul_(scale)
    peft_model.save_pretrained(dest)
    return dest


def peft_model(base: Path, adapter: Path, merged: bool = False) -> torch.nn.Module:
    """The base model with one adapter applied by PEFT (or merged into its weights)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    wrapped = PeftModel.from_pretrained(model, adapter).eval()
    return wrapped.merge_and_unload().eval() if merged else wrapped
