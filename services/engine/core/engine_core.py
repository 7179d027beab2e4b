"""EngineCore: one engine instance, synchronous. A step is schedule -> runner.execute ->
update (docs/engine-core.md "One step, three calls"), then detokenization, stop strings and the
RequestOutputs of the requests that changed. The async and offline front ends wrap it.

A request is checked once, at the engine's edge: `process()` refuses what could never run and
returns an EngineRequest, which `add()` queues without checking again. A request with structured
outputs waits outside the scheduler until its grammar is compiled (on the compiler's thread),
then enters the waiting queue carrying it.

The core is handed its runner and tokenizer (frontend/core_builder.py builds them): it imports
no torch, no model code and no tokenizer library (tests/unit/test_layering.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from shoal.services.engine.config import EngineConfig
from shoal.services.engine.core.grammar_gate import GrammarGate
from shoal.services.engine.core.outputs import RunnerOutput, SchedulerOutput, TokenLogprob
from shoal.services.engine.core.request_output import EngineStats, RequestOutput, RequestOutputKind
from shoal.services.engine.core.request_state import EngineRequest, RequestState, Resumed
from shoal.services.engine.lora_request import LoRARequest
from shoal.services.engine.sampling_params import SamplingParams
from shoal.services.engine.core.scheduler import Scheduler
from shoal.services.engine.core.sequence import Sequence, SequenceStatus
from shoal.shared.errors import InvalidRequest

COMPILE_WAIT_S = 0.05
"""With nothing to run but grammars compiling, a step waits this long for one at most."""


class Runner(Protocol):
    """What EngineCore needs of the model runner (runner/model_runner.ModelRunner, the
    distributed executor, or a test fake)."""

    max_model_len: int
    num_kv_blocks: int
    eos_token_ids: frozenset[int]
    vocab_size: int

    def execute(self, out: SchedulerOutput) -> RunnerOutput: ...


class LoRARunner(Protocol):
    """What a runner adds for LoRA adapters (enable_lora): load one into its host cache,
    checking it against the model (InvalidRequest with the reason), and drop one."""

    def add_lora(self, lora: LoRARequest) -> None: ...

    def remove_lora(self, lora: LoRARequest) -> None: ...


class EngineCore:
    def __init__(self, config: EngineConfig, *, runner: Runner, tokenizer: Any,
                 model_dir: Path | None = None) -> None:
        """model_dir: the prepared model folder the runner loaded (None for a test's runner)."""
        self.config = config
        self.model_dir = model_dir
        self.runner = runner
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(config, runner.num_kv_blocks, runner.max_model_len,
                                   frozenset(runner.eos_token_ids))
        self._requests: dict[str, RequestState] = {}
        self.grammar_gate = GrammarGate(tokenizer, runner.vocab_size, runner.eos_token_ids)
        self.vocab_bound = min(len(tokenizer), runner.vocab_size)
        """Token ids in [0, vocab_bound) both have an embedding row and decode to text."""
        self._next_seq_id = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self.on_step_tokens: Callable[[int], None] | None = None
        """Called with each step's batched tokens (vllm:iteration_tokens_total)."""
        self.loras: dict[int, LoRARequest] = {}
        """The adapters added (lora_int_id -> request): checked and loaded by the runner."""
        self.lora_requests: dict[str, int] = {}
        """Requests run per adapter name since start (vllm:lora_requests_info)."""

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    def process(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                arrival_time: float | None = None, *, prompt: str | None = None,
                output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                lora_request: LoRARequest | None = None,
                resume: Resumed | None = None) -> EngineRequest:
        """The engine's one check of a request: InvalidRequest (400) for one that could never
        run. Read-only, so a front end may call it on its own thread (the grammar is parsed here,
        once, and the parse is cached for its compile). An adapter not added yet is loaded by
        add(), on the engine's thread."""
        if lora_request is not None and not self.config.enable_lora:
            raise InvalidRequest(f"LoRA adapter {lora_request.lora_name!r} requested but LoRA is "
                                 "not enabled (start the engine with enable_lora)",
                                 param="lora_request")
        prompt_token_ids = list(prompt_token_ids)
        bound = self.vocab_bound
        if not all(isinstance(t, int) and 0 <= t < bound for t in prompt_token_ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {bound})",
                                 param="prompt")
        if params.logit_bias and max(params.logit_bias) >= bound:
            raise InvalidRequest(f"logit_bias keys must be token ids in [0, {bound}), got "
                                 f"{max(params.logit_bias)}", param="logit_bias")
        self.scheduler.check_request(len(prompt_token_ids), params)
        if params.structured_outputs is not None:
            self.grammar_gate.check(params.structured_outputs)
        if resume is not None:
            self._check_resume(resume, len(prompt_token_ids), params)
        return EngineRequest(request_id, prompt_token_ids, params,
                             time.time() if arrival_time is None else arrival_time, prompt,
                             output_kind, lora_request, resume)

    def _check_resume(self, resume: Resumed, prompt_len: int, params: SamplingParams) -> None:
        """One sequence, no grammar (its matcher would have to replay the tokens), ids in the
        vocabulary, room left in the context."""
        if params.n != 1 or params.structured_outputs is not None:
            raise InvalidRequest("a resumed request must have n = 1 and no structured output",
                                 param="resume")
        if not all(0 <= t < self.vocab_bound for t in resume.token_ids):
            raise InvalidRequest(f"resumed token ids must be in [0, {self.vocab_bound})",
                                 param="resume")
        if prompt_len + len(resume.token_ids) >= self.max_model_len:
            raise InvalidRequest("the resumed output leaves no room in the context",
                                 param="resume")

    def add(self, request: EngineRequest) -> None:
        """Queue a processed request (its id must not be in use)."""
        request_id, params = request.request_id, request.params
        if request_id in self._requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        lora = request.lora_request
        if lora is not None:
            if self.loras.get(lora.lora_int_id) != lora:
                self.add_lora(lora)  # InvalidRequest with the reason: nothing is queued
            self.lora_requests[lora.lora_name] = self.lora_requests.get(lora.lora_name, 0) + 1
        num_tokens = len(request.prompt_token_ids)
        prior = list(request.resume.token_ids) if request.resume is not None else []
        # (resumed tokens' logprobs are never sent: placeholders keep the indices)
        placeholders = ([TokenLogprob(t, 0.0, 1) for t in prior] if params.logprobs is not None
                        else [])
        seqs = [Sequence(self._next_seq_id + i, request_id, list(request.prompt_token_ids) + prior,
                         num_tokens, params, index=i, arrival_time=request.arrival_time,
                         lora_request=lora, num_resumed=len(prior), logprobs=list(placeholders))
                for i in range(params.n)]
        self._next_seq_id += params.n
        if params.structured_outputs is not None:
            self.grammar_gate.park(request_id, params.structured_outputs, seqs)
        else:
            self.scheduler.add(seqs)
        self._requests[request_id] = RequestState.new(request, seqs, self.tokenizer)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, *, prompt: str | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                    lora_request: LoRARequest | None = None,
                    resume: Resumed | None = None) -> None:
        """process() then add(): the offline path, where the edge and the core are one."""
        self.add(self.process(request_id, prompt_token_ids, params, arrival_time, prompt=prompt,
                              output_kind=output_kind, lora_request=lora_request,
                              resume=resume))

    def add_lora(self, lora: LoRARequest) -> None:
        """Load an adapter (vLLM's add_lora): the runner checks it against the model and keeps
        it in host memory; InvalidRequest (400) with the reason when it cannot serve it. An id
        already in use by another adapter is refused; the same adapter again is a no-op."""
        if not self.config.enable_lora:
            raise InvalidRequest("LoRA is not enabled (start the engine with enable_lora)",
                                 param="lora_request")
        known = self.loras.get(lora.lora_int_id)
        if known == lora:
            return
        if known is not None:
            raise InvalidRequest(f"lora_int_id {lora.lora_int_id} is already used by adapter "
                                 f"{known.lora_name!r}", param="lora_int_id")
        add = getattr(self.runner, "add_lora", None)
        if add is None:
            raise InvalidRequest("this engine's runner cannot load LoRA adapters",
                                 param="lora_request")
        add(lora)
        self.loras[lora.lora_int_id] = lora

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (vLLM's remove_lora): the runner frees it once no running
        sequence uses it. False when no adapter has that id."""
        lora = self.loras.pop(lora_int_id, None)
        if lora is None:
            return False
        remove = getattr(self.runner, "remove_lora", None)
        in_use = any(s.lora_request == lora for s in self.scheduler.seqs.values())
        if remove is not None and not in_use:  # (else the runner's LRUs let it go in time)
            remove(lora)
        return True

    def list_loras(self) -> set[int]:
        """The ids of the adapters added (vLLM's list_loras)."""
        return set(self.loras)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request wherever it is; returns its final output (finish_reason "abort")."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        self.scheduler.abort(request_id)
        for seq in self.grammar_gate.discard(request_id):
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        for detok in req.detoks:
            detok.finish()
        del self._requests[request_id]
        return req.make_output(force=True)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.grammar_gate)

    def has_requests(self) -> bool:
        """Requests left to run or report (has_unfinished() less the runner's clean-up of
        finished sequences, which the next step does along with its batch)."""
        return self.scheduler.has_requests() or bool(self.grammar_gate)

    def step(self) -> list[RequestOutput]:
        failed = self._admit_compiled()
        out = self.scheduler.schedule()
        if out.scheduled and self.on_step_tokens is not None:
            self.on_step_tokens(out.num_batched_tokens)
        run = (self.runner.execute(out) if out.scheduled or out.finished_seq_ids
               else RunnerOutput({}))
        changed = self.scheduler.update(out, run)
        dead_ends = {seq.request_id: seq for seq in changed
                     if seq.seq_id in run.grammar_dead_ends} if run.grammar_dead_ends else {}
        touched: dict[str, RequestState] = {}
        for seq in changed:
            req = self._requests.get(seq.request_id)
            if req is None or req.request_id in dead_ends:
                continue
            touched[req.request_id] = req
            self._detokenize(req, seq)
        outputs = failed
        for req in touched.values():
            if not req.has_first_token and any(s.first_token_time for s in req.seqs):
                req.has_first_token = True
                self._num_prompt_tokens += len(req.request.prompt_token_ids)
            output = req.make_output()
            if output is not None:
                outputs.append(output)
            if req.is_finished:
                del self._requests[req.request_id]
        for seq in dead_ends.values():
            output = self._fail_dead_end(seq)
            if output is not None:
                outputs.append(output)
        return outputs

    def _fail_dead_end(self, seq: Sequence) -> RequestOutput | None:
        """End a request whose grammar allowed no token (its last token is the stop token the
        runner drew instead of sampling from nothing): aborted, with a 400 that says why."""
        spec = seq.params.structured_outputs
        kind = spec.kind if spec is not None else "grammar"
        output = self.abort(seq.request_id)
        if output is not None:
            output.error = InvalidRequest(
                f"the structured_outputs.{kind} allows no token after {seq.num_output_tokens - 1}"
                f" generated tokens: that branch can never end (a rule with no way out, or "
                f"text no token of this model spells)", param=f"structured_outputs.{kind}")
        return output

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar is ready join the scheduler (the step waits a little for one
        when nothing else can run). A compile that fails after the spec parsed aborts it."""
        if not self.grammar_gate:
            return []
        ready, failed = self.grammar_gate.take_ready(
            0.0 if self.scheduler.has_unfinished() else COMPILE_WAIT_S)
        for seqs, params in ready:
            self.scheduler.add(seqs, params)
        outputs = [self.abort(request_id) for request_id in failed]
        return [output for output in outputs if output is not None]

    def stats(self) -> EngineStats:
        bm = self.scheduler.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting + self.grammar_gate.num_seqs,
            kv_cache_usage=bm.usage, num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=bm.num_prefix_queries, prefix_cache_hits=bm.num_prefix_hits,
            prompt_tokens=self._num_prompt_tokens, generation_tokens=self._num_generation_tokens,
            spec_decode=(self.scheduler.spec_stats.copy() if self.scheduler.num_spec_tokens
                         else None),
            running_loras=_lora_names(self.scheduler.running) if self.config.enable_lora else (),
            waiting_loras=_lora_names(self.scheduler.waiting) if self.config.enable_lora else ())

    def _detokenize(self, req: RequestState, seq: Sequence) -> None:
        num_new, stop, keep = req.detokenize(seq)
        self._num_generation_tokens += num_new
        if stop is not None:
            self.scheduler.stop_at_string(seq, stop, keep)
        if seq.is_finished:
            req.detoks[seq.index].finish()


def _lora_names(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    return tuple(sorted({s.lora_request.lora_name for s in seqs if s.lora_request is not None}))
