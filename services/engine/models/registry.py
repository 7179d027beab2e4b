"""Hugging Face architecture name -> our model class (the only place that lists them)."""

from __future__ import annotations

from typing import Any

from shoal.services.engine.config import ConfigError
from shoal.services.engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from shoal.services.engine.models.gpt_oss import GptOssForCausalLM
from shoal.services.engine.models.granite import GraniteForCausalLM
from shoal.services.engine.models.llama import (
    LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
)
from shoal.services.engine.models.moe_models import (
    MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
)
from shoal.services.engine.models.olmoe import OlmoeForCausalLM
from shoal.services.engine.models.phi3 import Phi3ForCausalLM
from shoal.services.engine.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
}


def model_class(hf_config: Any) -> type[LlamaForCausalLM]:
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in MODEL_CLASSES:
            return MODEL_CLASSES[arch]
    raise ConfigError(f"unsupported architecture {getattr(hf_config, 'architectures', None)}; "
                      f"supported: {', '.join(sorted(MODEL_CLASSES))}")
