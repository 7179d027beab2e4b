"""Verification of draft tokens against the target's distributions, batched, pure tensors.

Every proposer here drafts deterministically (a point-mass draft distribution q), so the standard
speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023) reads: accept draft d_j with
probability min(1, p_j(d_j) / q_j(d_j)) = p_j(d_j); at the first rejection draw from the residual
norm(max(0, p_j - q_j)) = p_j with d_j removed; when all are accepted draw a bonus token from
p_k. Each emitted token is then distributed exactly as p. Greedy is the limit: accept while the
draft equals the argmax, then emit the argmax.
"""

from __future__ import annotations

import torch


def rejection_sample(probs: torch.Tensor, draft: torch.Tensor, num_drafts: torch.Tensor,
                     uniform: torch.Tensor, race: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [B, K+1, V] the target's distributions at each verified position (rows sum to 1),
    draft [B, K] int64 (entries past num_drafts ignored), num_drafts [B], uniform [B, K] in
    [0, 1), race [B, V] Exp(1) noise -> (num_accepted [B], the next token [B]): the emitted
    tokens are draft[:num_accepted] followed by that token."""
    b, k = draft.shape
    rows = torch.arange(b, device=probs.device)
    p_draft = probs[:, :k].gather(2, draft[:, :, None])[:, :, 0]  # [B, K]
    live = torch.arange(k, device=probs.device)[None, :] < num_drafts[:, None]
    accept = (uniform < p_draft) & live
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # leading accepts
    final = probs[rows, num_accepted]  # [B, V]: p at the first rejection, or the bonus row
    rejected = num_accepted < num_drafts
    rejected_token = draft.gather(1, num_accepted.clamp(max=max(k - 1, 0))[:, None])[:, 0]
    residual = final.clone()
    residual[rows[rejected], rejected_token[rejected]] = 0.0
    empty = residual.sum(dim=1) <= 0  # rounding: p was all on the rejected draft
    residual[empty] = final[empty]
    # Exponential race: argmax(w / q), q ~ Exp(1), draws proportionally to the weights w.
    return num_accepted, (residual / race).argmax(dim=1)


def greedy_accept(argmax: list[int], draft: list[int]) -> int:
    """How many leading drafts equal the target's argmax at their position."""
    n = 0
    while n < len(draft) and draft[n] == argmax[n]:
        n += 1
    return n
