"""ModelRunner: owns the model, its KV caches and per-sequence sampling state; runs one step.

`execute(SchedulerOutput) -> RunnerOutput`: flatten the batch (input_batch.py), one forward over
the paged cache, logits only where needed, sample (sampler.py). It never touches scheduler state.

Under tensor / pipeline parallelism each rank has its own runner over its shard of the model
(distributed/executor.py drives them); a stage that is not the last hands its activations on
(distributed/pipeline.py) and returns an empty RunnerOutput.
"""

from __future__ import annotations

import gc
import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from shoal.kernels import Workspace, select_ops
from shoal.services.engine.config import ENGINE_DEFAULTS, ConfigError, EngineConfig
from shoal.services.engine.runner.cpu_threads import ContentionGuard, cpu_list, cpu_threads
from shoal.services.engine.runner.cuda_graphs import DecodeGraphs
from shoal.services.engine.distributed.parallel_state import ParallelContext
from shoal.services.engine.distributed.pipeline import run_stage
from shoal.services.engine.runner.gpu_memory import profiled_config
from shoal.services.engine.runner.input_batch import ModelInputs, build_model_inputs
from shoal.services.engine.runner.kv_cache import attention_layers, bind_kv_caches, num_kv_blocks
from shoal.services.engine.layers.cpu_weights import (gguf_source, prepare_cpu_weights,
                                                      resolve_quantization)
from shoal.services.engine.runner.loader import building_in, load_model_weights
from shoal.services.engine.gguf_folder import omitted_weights
from shoal.services.engine.layers.gguf_weights import GGUFSource, block_weight_names
from shoal.services.engine.runner.lora_manager import LoRAManager
from shoal.services.engine.lora_request import LoRARequest
from shoal.services.engine.model_limits import context_limit, resolve_max_model_len
from shoal.services.engine.models.registry import model_class
from shoal.services.engine.core.outputs import (RunnerOutput, ScheduledSeq, SchedulerOutput,
                                               TokenLogprob)
from shoal.services.engine.runner.sampler import SeqState, logprob_entries, mix_seed, sample
from shoal.services.engine.spec_decode.runner_step import SpecStep
from shoal.shared.errors import ShoalError

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path,
                 parallel: ParallelContext | None = None) -> None:
        self.config = config
        self.parallel = parallel or ParallelContext.single()
        model_dir = Path(model_dir)
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto"
            else config.device)
        threads_note = ""
        self.contention: ContentionGuard | None = None
        if config.num_threads or self.device.type == "cpu":
            threads, threads_note = cpu_threads(config.num_threads)
            torch.set_num_threads(threads)
            if (threads_note.startswith("default") and threads > 1
                    and self.parallel.world_size == 1):  # (ranks step in lockstep: no guard)
                self.contention = ContentionGuard(threads, len(os.sched_getaffinity(0)))
                threads_note += ", fewer while other processes keep cores busy"
        self.dtype = getattr(torch, ENGINE_DEFAULTS.dtype(config.dtype, self.device.type))
        hf_config = AutoConfig.from_pretrained(model_dir)
        self.hf_config = hf_config
        self.max_model_len = _max_model_len(config, hf_config)
        self.vocab_size: int = hf_config.vocab_size
        self.eos_token_ids = _eos_token_ids(model_dir, hf_config)
        self.ops = ops = select_ops(self.device)
        with building_in(self.dtype, self.device):  # no float32 copy of the weights first
            self.model = model_class(hf_config)(hf_config, self.max_model_len, ops, self.parallel)
        self.quantization = (resolve_quantization(config.quantization, config.model,
                                                  self.parallel.world_size)
                             if self.device.type == "cpu" else config.quantization)
        blocks_folder = omitted_weights(model_dir) is not None
        gguf_path = gguf_source(config.model)
        gguf: Path | GGUFSource | None = gguf_path
        gguf_cache = model_dir / "gguf-blocks" / "blocks.safetensors"
        supplied: frozenset[str] = frozenset()  # (their blocks, not a dense copy, are what runs)
        if blocks_folder and gguf_path is not None and self.quantization == "gguf":
            if not gguf_cache.is_file():  # both steps read the file: its metadata parsed once
                gguf = GGUFSource(gguf_path)
            supplied = block_weight_names(self.model, gguf, gguf_cache)
        load_model_weights(self.model, model_dir, config.load_format, supplied)
        for param in self.model.parameters():  # (a no-op unless a loader swapped the tensor)
            param.data = param.data.to(device=self.device, dtype=self.dtype)
        self.model.to(self.device).eval()  # buffers (rotary cos/sin) stay float32
        """What the CPU weights run as (a .gguf model: its own blocks unless "none" is asked)."""
        if self.device.type == "cpu":
            matmul = prepare_cpu_weights(self.model, self.quantization, gguf, gguf_cache,
                                         config.cpu_gemv, check_gguf=not blocks_folder)
            self.settings = (f"CPU: {torch.get_num_threads()} torch intra-op threads "
                             f"({threads_note}), {torch.get_num_interop_threads()} inter-op, "
                             f"affinity {cpu_list(os.sched_getaffinity(0))}, "
                             f"{self.dtype}, matmuls: {matmul}, attention: {ops.describe()}")
        elif config.quantization not in (None, "none"):
            raise ConfigError("quantization is implemented on the CPU path only",
                              param="quantization")
        else:
            self.settings = f"{self.device}: {self.dtype}, {ops.describe()}"
        self.lora: LoRAManager | None = None
        """LoRA adapters (enable_lora): loaded, checked, and set on each step's layers."""
        if config.enable_lora:
            self.lora = LoRAManager(self.model, model_name=config.model,
                                    max_loras=config.max_loras,
                                    max_lora_rank=config.max_lora_rank,
                                    max_cpu_loras=config.max_cpu_loras, device=self.device,
                                    dtype=self.dtype)
            self.settings += (f", LoRA: {config.max_loras} adapters a step, rank <= "
                              f"{config.max_lora_rank}")
        log.info("engine settings: %s", self.settings)
        self.block_size = config.block_size
        kv_config = config
        if self.device.type == "cuda" and self.parallel.pp_size == 1:  # CUDA: size the pool by
            # profiling a full-size batch (a pipeline stage cannot run a forward on its own)
            kv_config = profiled_config(config, self.model, self.max_model_len, self.dtype,
                                        self.device)
        # every rank's pool holds the same blocks: the fewest any rank (stage) can afford
        self.num_kv_blocks = self.parallel.min_over_world(
            num_kv_blocks(kv_config, self.model, self.dtype, self.device))
        self.kv_caches = bind_kv_caches(self.model, self.num_kv_blocks, self.block_size,
                                        self.dtype, self.device)
        self.workspace = Workspace()
        self.graphs: DecodeGraphs | None = None
        if (self.device.type == "cuda" and not config.enforce_eager
                and self.parallel.world_size == 1  # CUDA path: decode graphs (one rank only)
                and self.model.cuda_graphs and self.lora is None):  # (LoRA steps run eagerly)
            self.graphs = DecodeGraphs(self.model, config.max_num_seqs,
                                       -(-self.max_model_len // self.block_size), self.device)
            self.graphs.capture()
        self.states: dict[int, SeqState] = {}
        self._num_unseeded = 0
        self.spec = SpecStep.build(config.speculative_config, self)
        """Speculative decoding (spec_decode/): proposes, and verifies what it proposed."""

    def close(self) -> None:
        """Let go of the weights, the KV pool, the CUDA graphs and the draft model now, and hand
        the freed blocks back to the device: a second engine in this process (a new `LLM` after
        `with LLM(...)` ends) gets the memory, as vLLM's does after shutdown. Idempotent."""
        if self.model is None:
            return
        for layer in attention_layers(self.model):  # the layers hold views of the pool
            layer.k_cache = layer.v_cache = None
        self.model = self.kv_caches = self.graphs = self.spec = None  # type: ignore[assignment]
        self.lora = None
        self.states.clear()
        self.workspace = Workspace()
        gc.collect()  # the model's modules refer to each other: collect them before emptying
        if self.device.type == "cuda":
            # cuBLAS keeps a workspace per stream it ran on (32 MiB on an H100), the graph
            # capture stream's included: the first GPU run found it still held after close
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            torch.cuda.empty_cache()

    def add_lora(self, lora: LoRARequest) -> None:
        """Load and check an adapter (InvalidRequest with the reason when it cannot serve)."""
        if self.lora is None:
            raise ShoalError("this engine was started without enable_lora")
        self.lora.add(lora)

    def remove_lora(self, lora: LoRARequest) -> None:
        if self.lora is not None:
            self.lora.remove(lora)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if self.model is None:
            raise ShoalError("this engine has been shut down: its model and KV cache are freed")
        if self.contention is None or out.is_empty:
            return self._execute(out)
        self.contention.before_step()  # here, on the stepping thread: OpenMP's thread count
        try:  # belongs to the thread that sets it
            return self._execute(out)
        finally:
            self.contention.after_step()

    @torch.inference_mode()
    def _execute(self, out: SchedulerOutput) -> RunnerOutput:
        for seq_id in out.finished_seq_ids:
            self.states.pop(seq_id, None)
        if out.is_empty:
            return RunnerOutput(sampled_token_ids={})
        states = [self._update_state(s) for s in out.scheduled]
        drafts = self.spec.propose(out.scheduled, states) if self.spec else None
        if drafts is not None:  # feed each sequence's drafts after its token
            out = SchedulerOutput([replace(s, token_ids=s.token_ids + d) if d else s
                                   for s, d in zip(out.scheduled, drafts, strict=True)],
                                  out.finished_seq_ids, out.num_preempted)
        inputs = build_model_inputs(out, self.block_size, self.device, self.workspace,
                                    [len(d) for d in drafts] if drafts is not None else None)
        if self.lora is not None:
            self.lora.set_batch(out.scheduled, [len(s.token_ids) for s in out.scheduled])
        try:
            return self._forward(out, states, drafts, inputs)
        finally:
            if self.lora is not None:
                self.lora.clear_batch()

    def _forward(self, out: SchedulerOutput, states: list[SeqState],
                 drafts: list[list[int]] | None, inputs: ModelInputs) -> RunnerOutput:
        if self.parallel.pp_size > 1:
            hidden = run_stage(self.model, inputs, self.parallel, self.dtype, self.device)
            if hidden is None:  # not the last stage: the last one samples
                return RunnerOutput(sampled_token_ids={})
        elif self.graphs is not None and self.graphs.can_run(inputs):  # CUDA: replay a graph
            hidden = self.graphs.run(inputs)
        else:
            # [num_tokens, hidden]
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        logits = self.model.compute_logits(hidden, inputs.logits_indices)  # [num_logits, vocab]
        prompt_logprobs = self._prompt_logprobs(out.scheduled, states, inputs, logits)
        picked = [i for i, row in enumerate(inputs.sample_rows) if row is not None]
        spec_out = None
        if drafts is not None and any(drafts):
            spec_out = self.spec.verify(out.scheduled, states, drafts, inputs.sample_rows, logits)
            picked = [i for i in picked if not drafts[i]]
        if not picked:
            return RunnerOutput(sampled_token_ids={}, prompt_logprobs=prompt_logprobs).merged(
                spec_out)
        rows = [inputs.sample_rows[i] for i in picked]
        if len(rows) != logits.shape[0]:
            logits = logits[rows]
        tokens, logprobs = sample(logits, [states[i] for i in picked], self.eos_token_ids)
        seq_ids = [out.scheduled[i].seq_id for i in picked]
        return RunnerOutput(
            sampled_token_ids=dict(zip(seq_ids, tokens, strict=True)),
            logprobs={sid: lp for sid, lp in zip(seq_ids, logprobs, strict=True) if lp is not None},
            prompt_logprobs=prompt_logprobs,
            grammar_dead_ends=[out.scheduled[i].seq_id for i in picked
                               if (g := states[i].grammar) is not None and g.dead_end],
        ).merged(spec_out)

    def _update_state(self, s: ScheduledSeq) -> SeqState:
        state = self.states.get(s.seq_id)
        if state is None:
            state = SeqState(params=s.sampling_params, token_ids=[], prompt_len=s.prompt_len)
            if not s.sampling_params.is_greedy:
                state.generator = torch.Generator(device=self.device)
                if s.sampling_params.seed is not None:
                    state.generator.manual_seed(mix_seed(s.sampling_params.seed, s.seed_offset))
                else:
                    state.generator.manual_seed(mix_seed(self.config.seed, self._num_unseeded))
                    self._num_unseeded += 1
                for _ in range(s.num_resumed):  # one uniform per sampled token (sampler.py)
                    torch.rand(1, generator=state.generator, device=self.device)
            self.states[s.seq_id] = state
        if s.prefix_token_ids is not None:
            state.token_ids = list(s.prefix_token_ids) + list(s.token_ids)
            state.draft_pos = 0
        elif s.start_pos == 0:
            state.token_ids = list(s.token_ids)
            state.draft_pos = 0
        else:
            state.token_ids.extend(s.token_ids)
        state.prompt_len = s.prompt_len
        return state

    def _prompt_logprobs(self, scheduled: list[ScheduledSeq], states: list[SeqState],
                         inputs: ModelInputs, logits: torch.Tensor
                         ) -> dict[int, list[TokenLogprob | None]]:
        """Chunk [a, b) -> entries for prompt tokens a .. min(b, prompt_len) - 1 (None for 0)."""
        result: dict[int, list[TokenLogprob | None]] = {}
        for s, state, first in zip(scheduled, states, inputs.chunk_rows, strict=True):
            if first is None:
                continue
            num = s.sampling_params.prompt_logprobs or 0
            a, b = s.start_pos, s.start_pos + len(s.token_ids)
            end = min(b, s.prompt_len)  # positions a .. end - 1 hold prompt tokens
            entries: list[TokenLogprob | None] = [None] if a == 0 else []
            pending, state.pending_prompt_lp = state.pending_prompt_lp, None
            if a > 0 and pending is not None and a < s.prompt_len:
                entries += logprob_entries(pending[None], torch.tensor([s.token_ids[0]]), [num])
            if end - a > 1:  # positions a .. end - 2 predict tokens a + 1 .. end - 1
                lps = torch.log_softmax(logits[first:first + end - a - 1], dim=-1)
                targets = torch.tensor(state.token_ids[a + 1:end], device=lps.device)
                entries += logprob_entries(lps, targets, [num] * (end - a - 1))
            if end < s.prompt_len and end > a:  # the last position predicts the next chunk's token
                state.pending_prompt_lp = torch.log_softmax(logits[first + end - a - 1], dim=-1)
            result[s.seq_id] = entries
        return result


def _max_model_len(config: EngineConfig, hf_config: Any) -> int:
    """The user's limit, or the model's whole length (model_limits.py: rope scaling considered;
    sliding-window layers need no cap: the kernels apply the window, as vLLM does)."""
    return resolve_max_model_len(config.max_model_len, context_limit(hf_config.to_dict()))


def _eos_token_ids(model_dir: Path, hf_config: Any) -> frozenset[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer's eos_token."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    gen_file = model_dir / "generation_config.json"
    if gen_file.is_file():
        add(json.loads(gen_file.read_text()).get("eos_token_id"))
    add(getattr(hf_config, "eos_token_id", None))
    tok_file, tok_cfg = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
    if tok_file.is_file() and tok_cfg.is_file():
        eos = json.loads(tok_cfg.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        for added in json.loads(tok_file.read_text()).get("added_tokens", []):
            if added.get("content") == eos:
                add(added.get("id"))
    return frozenset(ids)
