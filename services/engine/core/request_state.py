"""What the engine keeps per request beside its sequences: the checked request (EngineRequest),
and RequestState, one detokenizer per child and what was already sent, from which each step's
RequestOutput is built (the per-request half of vLLM's output processor).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from shoal.services.engine.core.detokenizer import IncrementalDetokenizer
from shoal.services.engine.core.request_output import (CompletionOutput, RequestMetrics,
                                                       RequestOutput, RequestOutputKind)
from shoal.services.engine.lora_request import LoRARequest
from shoal.services.engine.sampling_params import SamplingParams
from shoal.services.engine.core.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A request that passed the engine's checks (EngineCore.process), ready to add."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    prompt: str | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    lora_request: LoRARequest | None = None
    resume: Resumed | None = None


@dataclass(frozen=True, slots=True)
class Resumed:
    """Output a request resumes from (a stream failed over from a dead engine, n = 1): its
    tokens count as generated, their text as already sent."""

    token_ids: tuple[int, ...]
    text: str = ""


@dataclass(slots=True)
class RequestState:
    request: EngineRequest
    seqs: list[Sequence]
    """One per child (n > 1 gives n)."""
    detoks: list[IncrementalDetokenizer]
    num_decoded: list[int] = field(default_factory=list)
    """Per child: output tokens handed to its detokenizer."""
    num_sent: list[int] = field(default_factory=list)
    """Per child: output tokens already sent (delta mode)."""
    sent_finished: list[bool] = field(default_factory=list)
    sent_prompt_logprobs: bool = False
    has_first_token: bool = False

    @classmethod
    def new(cls, request: EngineRequest, seqs: list[Sequence], tokenizer: Any) -> RequestState:
        n = len(seqs)
        detoks = [IncrementalDetokenizer(tokenizer, request.prompt_token_ids, request.params)
                  for _ in seqs]
        state = cls(request, seqs, detoks, [0] * n, [0] * n, [False] * n)
        if request.resume is not None:  # decoded, never sent again; stops may span the seam
            done = len(request.resume.token_ids)
            detoks[0].update(list(request.resume.token_ids), check_stop=False)
            detoks[0].num_released = min(len(request.resume.text), len(detoks[0].text))
            state.num_decoded[0] = state.num_sent[0] = done
        return state

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def detokenize(self, seq: Sequence) -> tuple[int, str | None, int | None]:
        """Hand a child's new output tokens to its detokenizer: (how many tokens were new, the
        stop string found in the text, if any, and how many output tokens to keep: None for
        all; fewer when several arrived at once and one before the last completed the stop).
        The EOS or stop token is not part of the text. Reads seq only: the scheduler ends it."""
        params = self.request.params
        output_ids = seq.output_token_ids
        end = len(output_ids)
        stopped_by_token = (seq.status is SequenceStatus.FINISHED_STOPPED
                            and not isinstance(seq.stop_reason, str))
        if stopped_by_token and not params.include_stop_str_in_output:
            end -= 1
        start = self.num_decoded[seq.index]
        new_ids = output_ids[start:end]
        detok = self.detoks[seq.index]
        if params.stop and len(new_ids) > 1:  # several tokens (speculation): stop at the first
            for i, token_id in enumerate(new_ids):
                stop = detok.update([token_id], check_stop=start + i + 1 > params.min_tokens)
                if stop is not None:  # the tokens after it are dropped, as if never sampled
                    keep = start + i + 1
                    self.num_decoded[seq.index] = keep
                    return keep - start, stop, keep
            self.num_decoded[seq.index] = len(output_ids)
            return len(output_ids) - start, None, None
        self.num_decoded[seq.index] = len(output_ids)
        stop = detok.update(new_ids, check_stop=seq.num_output_tokens > params.min_tokens)
        return len(output_ids) - start, stop, None

    def make_output(self, force: bool = False) -> RequestOutput | None:
        """This step's output (None for FINAL_ONLY until the request finishes, unless forced)."""
        kind = self.request.output_kind
        finished = self.is_finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished and not force:
            return None
        delta = kind is RequestOutputKind.DELTA
        want_logprobs = self.request.params.logprobs is not None
        completions = []
        for i, (seq, detok) in enumerate(zip(self.seqs, self.detoks)):
            start = self.num_sent[i] if delta else 0
            token_ids = seq.output_token_ids[start:]
            text = detok.take_delta() if delta else detok.releasable_text
            newly_finished = seq.is_finished and not self.sent_finished[i]
            if delta and not token_ids and not text and not newly_finished:
                continue
            self.num_sent[i] = seq.num_output_tokens
            self.sent_finished[i] = seq.is_finished
            completions.append(CompletionOutput(
                index=i, text=text, token_ids=token_ids,
                cumulative_logprob=seq.cumulative_logprob if want_logprobs else None,
                logprobs=seq.logprobs[start:] if want_logprobs else None,
                finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason))
        request = self.request
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=self._prompt_logprobs(delta), outputs=completions, finished=finished,
            num_cached_tokens=self.seqs[0].num_cached_tokens, metrics=self._metrics(finished))

    def _prompt_logprobs(self, delta: bool) -> list[Any] | None:
        first = self.seqs[0]
        if self.request.params.prompt_logprobs is None or first.wants_prompt_logprobs:
            return None  # not asked for, or not all computed yet
        if delta and self.sent_prompt_logprobs:
            return None
        self.sent_prompt_logprobs = True
        return list(first.prompt_logprobs)

    def _metrics(self, finished: bool) -> RequestMetrics:
        scheduled = [s.first_scheduled_time for s in self.seqs
                     if s.first_scheduled_time is not None]
        first_tokens = [s.first_token_time for s in self.seqs if s.first_token_time is not None]
        return RequestMetrics(
            arrival_time=self.request.arrival_time,
            first_scheduled_time=min(scheduled) if scheduled else None,
            first_token_time=min(first_tokens) if first_tokens else None,
            last_token_time=time.time() if first_tokens else None,
            finished_time=time.time() if finished else None)
