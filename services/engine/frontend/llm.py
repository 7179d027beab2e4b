"""LLM: the offline front end with vLLM's names (`LLM(model=...).generate(prompts, params)`,
`chat(messages)`): it feeds an EngineCore and steps it until every request has finished.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

from shoal.services.engine.frontend.core_builder import build_core
from shoal.services.engine.config import EngineConfig
from shoal.services.engine.input_processor import InputProcessor, Message, PromptType
from shoal.services.engine.core.engine_core import Runner
from shoal.services.engine.core.request_output import RequestOutput, RequestOutputKind
from shoal.services.engine.lora_request import LoRARequest
from shoal.services.engine.sampling_params import SamplingParams
from shoal.shared.errors import InvalidRequest


def _close_runner(runner: Runner) -> None:
    close = getattr(runner, "close", None)  # a test's runner may have none
    if close is not None:
        close()


class LLM:
    def __init__(self, model: str, *, runner: Runner | None = None, tokenizer_obj: Any = None,
                 **engine_args: Any) -> None:
        """engine_args are EngineConfig fields (max_num_seqs, kv_cache_memory,
        tensor_parallel_size, pipeline_parallel_size, ...); runner and tokenizer_obj replace the
        model runner and tokenizer (tests). With tp * pp > 1 the other ranks run as processes on
        this machine until shutdown() (or the `with` block's end)."""
        self.config = EngineConfig(model=model, **engine_args)
        self.engine = build_core(self.config, runner=runner, tokenizer=tokenizer_obj)
        self.inputs = InputProcessor(tokenizer=self.engine.tokenizer,
                                     max_model_len=self.engine.max_model_len,
                                     chat_template=self.config.chat_template)
        """Prompts and conversations as token ids, as the served engine makes them."""
        self._request_ids = itertools.count()
        # `del llm` (or the interpreter's exit) shuts down too; the finalizer holds the runner,
        # never this LLM, so it does not keep the LLM alive
        self._finalizer = weakref.finalize(self, _close_runner, self.engine.runner)

    def shutdown(self) -> None:
        """Free the model, the KV cache and CUDA graphs, and stop the engine's other ranks
        (tensor / pipeline parallel): a later LLM in this process gets the memory back."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; the outputs come back in the prompts' order.
        lora_request: one adapter for every prompt, or one (or None: the base model) per
        prompt, as vLLM's."""
        batch = self._as_batch(prompts)
        params = self._per_prompt(sampling_params, len(batch))
        loras = self._per_prompt_lora(lora_request, len(batch))
        request_ids: list[str] = []
        try:
            for prompt, p, lora in zip(batch, params, loras):
                text, token_ids = self.inputs.prompt(prompt)
                request_id = str(next(self._request_ids))
                self.engine.add_request(request_id, token_ids, p, prompt=text,
                                        output_kind=RequestOutputKind.FINAL_ONLY,
                                        lora_request=lora)
                request_ids.append(request_id)
        except BaseException:
            for request_id in request_ids:  # one bad prompt refuses the whole call
                self.engine.abort(request_id)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None,
             tools: list[dict[str, Any]] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Render each conversation (and the OpenAI-style `tools` offered) with the tokenizer's
        chat template, as the served chat completions do, then generate. `chat_template_kwargs`:
        more template variables (vLLM's, e.g. {"enable_thinking": False})."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts: list[PromptType] = []
        for conversation in conversations:
            text, ids = self.inputs.chat(conversation, tools=tools,  # type: ignore[arg-type]
                                         add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template,
                                         chat_template_kwargs=chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (vLLM's add_lora); InvalidRequest with the reason if refused."""
        self.engine.add_lora(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        return self.engine.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.error is not None:  # the others are aborted below
                        raise output.error
                    if output.finished:
                        done[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in request_ids:  # leave the engine clean for the next call
                self.engine.abort(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[request_id] for request_id in request_ids]

    @staticmethod
    def _as_batch(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(p, int) for p in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    @staticmethod
    def _per_prompt_lora(lora: LoRARequest | Sequence[LoRARequest | None] | None,
                         num: int) -> list[LoRARequest | None]:
        if lora is None or isinstance(lora, LoRARequest):
            return [lora] * num
        loras = list(lora)
        if len(loras) != num:
            raise InvalidRequest(f"got {len(loras)} LoRA requests for {num} prompts",
                                 param="lora_request")
        return loras

    @staticmethod
    def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                    num: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * num
        if isinstance(params, SamplingParams):
            return [params] * num
        params = list(params)
        if len(params) != num:
            raise InvalidRequest(f"got {len(params)} sampling params for {num} prompts",
                                 param="sampling_params")
        return params
