"""RequestLimits: what a request must fit to ever run on this engine. Checked once, at the
engine's edge (EngineCore.process -> Scheduler.check_request), and refused with InvalidRequest
(HTTP 400) naming the field, never truncated (docs/engine-core.md "Checked once, at the edge").
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.services.engine.sampling_params import SamplingParams
from shoal.shared.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool

    def check(self, prompt_len: int, params: SamplingParams) -> None:
        """Refuse (InvalidRequest) a request that could never run: an empty prompt, more tokens
        than max_model_len, more KV than the whole pool, and without chunked prefill more than
        max_num_batched_tokens."""
        if prompt_len < 1:
            raise InvalidRequest("the prompt must contain at least one token", param="prompt")
        wanted = prompt_len + (params.max_tokens or 1)
        if wanted > self.max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {wanted} tokens ({prompt_len} in the prompt, "
                f"{params.max_tokens or 1} for the completion).",
                param="prompt" if prompt_len >= self.max_model_len else "max_tokens")
        if -(-wanted // self.block_size) > self.num_kv_blocks:
            raise InvalidRequest(f"the request needs {wanted} tokens of KV cache but the pool "
                                 f"holds {self.num_kv_blocks * self.block_size}", param="prompt")
        if not self.enable_chunked_prefill:
            longest = prompt_len + (params.max_tokens or self.max_model_len - prompt_len)
            if longest > self.max_num_batched_tokens:
                raise InvalidRequest(f"without chunked prefill a request may use at most "
                                     f"max_num_batched_tokens={self.max_num_batched_tokens} "
                                     f"tokens, this one up to {longest}", param="prompt")
