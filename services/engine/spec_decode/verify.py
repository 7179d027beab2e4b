"""The runner's side of speculation for one sequence: verify its drafts on the logits of the
positions fed this step, with penalties and sampling settings applied per position exactly as an
ordinary step would apply them (position j sees the drafts before it as output tokens).
"""

from __future__ import annotations

import torch

from shoal.services.engine.runner.sampler import SeqState, apply_penalties, processed_probs
from shoal.services.engine.spec_decode.rejection import greedy_accept, rejection_sample


def verify(logits: torch.Tensor, state: SeqState, draft: list[int],
           eos_token_ids: frozenset[int]) -> tuple[list[int], int]:
    """logits [len(draft) + 1, vocab] (modified in place) -> (the accepted drafts, the token
    that follows them: the target's own at the first rejection, or a bonus token)."""
    p = state.params
    if _penalised(state):
        for j in range(len(draft) + 1):
            view = SeqState(params=p, token_ids=state.token_ids + draft[:j],
                            prompt_len=state.prompt_len)
            apply_penalties(logits[j], view, eos_token_ids)
    if p.temperature == 0.0:
        argmax: list[int] = logits.argmax(dim=-1).tolist()
        n = greedy_accept(argmax, draft)
        return draft[:n], argmax[n]
    probs = processed_probs(logits, [p] * (len(draft) + 1))
    probs = probs / probs.sum(dim=-1, keepdim=True)
    dev = logits.device
    assert draft, "a sequence without drafts is sampled the ordinary way"
    uniform = torch.rand(1, len(draft), generator=state.generator, device=dev)
    race = torch.empty(1, logits.shape[1], device=dev).exponential_(generator=state.generator)
    drafts = torch.tensor([draft], dtype=torch.int64, device=dev)
    n, token = rejection_sample(probs[None], drafts, torch.tensor([len(draft)], device=dev),
                                uniform, race)
    num = int(n[0])
    return draft[:num], int(token[0])


def _penalised(state: SeqState) -> bool:
    p = state.params
    return (p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)
            or bool(p.logit_bias)
            or len(state.token_ids) - state.prompt_len < p.min_tokens)
