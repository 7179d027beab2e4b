"""Sampling: grammar mask -> penalties -> logit_bias -> min_tokens -> temperature -> top-k /
top-p / min-p -> draw, and logprobs.

Logprobs come from the logits' log_softmax before penalties (vLLM's raw logprobs; a grammar mask,
applied first as in vLLM, shows as -inf). Every sampled sequence draws only from its own
torch.Generator, so a seeded request gives the same tokens whatever else is in the batch.
All-greedy batches take a one-argmax fast path; batches with no constrained row do no grammar
work at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shoal.services.engine.core.outputs import TokenLogprob
from shoal.services.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shoal.services.engine.structured_output.matcher import GrammarState


@dataclass(slots=True)
class SeqState:
    """What the runner keeps per sequence between steps (keyed on seq_id)."""

    params: SamplingParams
    token_ids: list[int]
    """Every token fed so far (prompt, then output): penalties and prompt-logprob targets."""
    prompt_len: int
    generator: torch.Generator | None = None
    pending_prompt_lp: torch.Tensor | None = None
    """[vocab] log-probs at the previous chunk's last position: they score the next chunk's first
    token, which that chunk did not know."""
    grammar: GrammarState | None = None
    """The matcher of a constrained sequence, made at its first sample (params.compiled_grammar)."""
    draft_pos: int = 0
    """Speculative decoding with a draft model: positions before this have the draft's KV."""


def mix_seed(seed: int, offset: int) -> int:
    return (seed * 6364136223846793005 + offset * 1442695040888963407 + 1) % (1 << 63)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] -> [rows] int64: argmax, the first index on ties as argmax gives it. On CPU
    `max(dim)`'s kernel is 1.6x faster than `argmax`'s over a 49k vocabulary (128 rows: 66 vs 106
    ms on a loaded core, same run; docs/figures.md, issue 13)."""
    return logits.max(dim=-1).indices


def sample(logits: torch.Tensor, states: list[SeqState], eos_token_ids: frozenset[int]
           ) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits [num_seqs, vocab] float32 (modified in place) -> (token per seq, logprob per seq)."""
    grammar_rows = [i for i, s in enumerate(states) if s.params.compiled_grammar is not None]
    if grammar_rows:
        _apply_grammars(logits, states, grammar_rows)
    lp_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    raw_lps = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None  # [len, vocab]
    # A finished grammar allows only EOS, which min_tokens bans: the grammar wins.
    guarded = [i for i in grammar_rows
               if len(states[i].token_ids) - states[i].prompt_len < states[i].params.min_tokens]
    masked = logits[guarded].clone() if guarded else None  # [len(guarded), vocab]
    for i, s in enumerate(states):
        apply_penalties(logits[i], s, eos_token_ids)
    for k, i in enumerate(guarded):
        if masked is not None and not bool(torch.isfinite(logits[i]).any()):
            logits[i] = masked[k]
    greedy = [s.params.temperature == 0.0 for s in states]
    if all(greedy):
        tokens = greedy_tokens(logits)
    else:
        tokens = torch.empty(len(states), dtype=torch.int64, device=logits.device)
        g_rows = [i for i, g in enumerate(greedy) if g]
        r_rows = [i for i, g in enumerate(greedy) if not g]
        if g_rows:
            tokens[g_rows] = greedy_tokens(logits[g_rows])
        random_logits = logits if not g_rows else logits[r_rows]  # (no copy when all sample)
        tokens[r_rows] = _sample_random(random_logits, [states[i] for i in r_rows])
    token_list: list[int] = tokens.tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(states)
    if raw_lps is not None:
        entries = logprob_entries(raw_lps, tokens[lp_rows],
                                  [states[i].params.logprobs or 0 for i in lp_rows])
        for i, entry in zip(lp_rows, entries):
            logprobs[i] = entry
    return token_list, logprobs


def _apply_grammars(logits: torch.Tensor, states: list[SeqState], rows: list[int]) -> None:
    """Mask the constrained rows: each sequence's matcher (made at its first sample) catches up
    with its output tokens, then forbids what its grammar does not allow next."""
    from shoal.services.engine.structured_output.matcher import GrammarState, apply_bitmask

    grammars = []
    for i in rows:
        s = states[i]
        if s.grammar is None:
            s.grammar = GrammarState.create(s.params.compiled_grammar)
        s.grammar.catch_up(s.token_ids, s.prompt_len)
        grammars.append(s.grammar)
    apply_bitmask(logits, rows, grammars)


def apply_penalties(row: torch.Tensor, s: SeqState, eos_token_ids: frozenset[int]) -> None:
    """row [vocab]: repetition (HF: prompt + output), presence/frequency (output), logit_bias,
    min_tokens."""
    p = s.params
    if p.repetition_penalty != 1.0 and s.token_ids:
        ids = torch.tensor(sorted(set(s.token_ids)), dtype=torch.int64, device=row.device)
        scores = row[ids]
        row[ids] = torch.where(scores < 0, scores * p.repetition_penalty,
                               scores / p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and len(s.token_ids) > s.prompt_len:
        output = torch.tensor(s.token_ids[s.prompt_len:], dtype=torch.int64, device=row.device)
        counts = torch.bincount(output, minlength=row.shape[0]).to(row.dtype)  # [vocab]
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    if p.logit_bias:  # a masked (-inf) token stays masked whatever its bias
        ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=row.device)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)
    if len(s.token_ids) - s.prompt_len < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        if banned:
            row[sorted(banned)] = float("-inf")


def _sample_random(x: torch.Tensor, states: list[SeqState]) -> torch.Tensor:
    """x [m, vocab] (penalised logits of the non-greedy rows) -> [m] sampled token ids.

    Inverse CDF: one uniform per row, from the row's own generator, searched in the row's
    cumulative distribution. The exponential race it replaces drew one number per vocabulary
    entry (49k per row): a third of a batch-128 decode step at temperature 1 (issue 13)."""
    probs = processed_probs(x, [s.params for s in states])
    cum = probs.cumsum(dim=-1)  # [m, vocab], not normalised (min-p)
    u = torch.cat([torch.rand(1, generator=s.generator, device=x.device) for s in states])
    tokens = torch.searchsorted(cum, (u * cum[:, -1])[:, None], right=True)[:, 0]
    tokens.clamp_(max=x.shape[1] - 1)
    # right=True skips zero-probability tokens; only a rounding at the very top (u * total ==
    # total) can land past the last token with mass: take that token then.
    stray = probs.gather(1, tokens[:, None])[:, 0] <= 0
    for r in stray.nonzero()[:, 0].tolist():
        tokens[r] = int((probs[r] > 0).nonzero()[-1, 0])
    return tokens


def processed_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """x [m, vocab] penalised logits -> [m, vocab] the distribution each row draws from
    (temperature, top-k / top-p, min-p; rows not normalised after min-p). Speculative
    verification accepts drafts against exactly this distribution."""
    dev = x.device
    x = x / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    top_ks = [p.top_k for p in params]
    top_ps = [p.top_p for p in params]
    if any(p < 1.0 for p in top_ps):
        x = _top_k_top_p(x, top_ks, top_ps)
    elif any(k > 0 for k in top_ks):
        vocab = x.shape[1]
        ks = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_ks], device=dev)
        top = x.topk(int(ks.max()), dim=-1).values  # [m, max_k] best first
        kth = top.gather(1, (ks - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(dim=-1)
    min_ps = [p.min_p for p in params]
    if any(min_ps):
        limit = torch.tensor(min_ps, device=dev)[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < limit, 0.0)
    return probs


def _top_k_top_p(x: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    vocab = x.shape[1]
    dev = x.device
    sorted_x, order = x.sort(dim=-1)  # ascending
    ks = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_ks], device=dev)
    kth = sorted_x.gather(1, (vocab - ks)[:, None])
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1 - torch.tensor(top_ps, device=dev)[:, None]
    drop[:, -1] = False  # always keep the most likely token
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def logprob_entries(lps: torch.Tensor, token_ids: torch.Tensor, nums: list[int]
                    ) -> list[TokenLogprob]:
    """lps [m, vocab] log-probs, token_ids [m] -> each token's logprob, 1-based rank, top-N."""
    chosen = lps.gather(1, token_ids[:, None])  # [m, 1]
    ranks = ((lps > chosen).sum(dim=1) + 1).tolist()
    k = max(nums, default=0)
    top_v: list[list[float]] = [[] for _ in nums]
    top_i: list[list[int]] = [[] for _ in nums]
    if k:
        values, indices = lps.topk(k, dim=-1)
        top_v, top_i = values.tolist(), indices.tolist()
    return [
        TokenLogprob(token_id=t, logprob=lp, rank=r, top=list(zip(ti[:n], tv[:n])))
        for t, lp, r, ti, tv, n in zip(token_ids.tolist(), chosen[:, 0].tolist(), ranks, top_i,
                                      top_v, nums)
    ]
