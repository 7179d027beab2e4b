"""Reference runs through transformers and the comparison rule for greedy parity.

Greedy tokens must match exactly; where one flips, it must be a near-tie: transformers'
logprobs of the two candidates at that step within 1e-4 (vLLM's check_logprobs_close). After
a justified flip the rest of that sequence is not compared (the contexts differ from there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE = 1e-4


@dataclass
class Reference:
    token_ids: list[int]  # generated tokens
    step_logprobs: list[torch.Tensor]  # per generated token: [vocab] log-probs of that step
    prompt_logprobs: torch.Tensor  # [prompt_len - 1, vocab]: position p predicts token p + 1


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> Reference:
    """One prompt at a time (no padding), full length (no EOS stop)."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        prompt_lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    steps = [torch.log_softmax(lg[0].float(), -1) for lg in out.logits]
    return Reference(out.sequences[0, len(prompt):].tolist(), steps, prompt_lp)


def assert_greedy_close(ours: list[int], ref: Reference, what: str) -> None:
    assert len(ours) == len(ref.token_ids), f"{what}: {len(ours)} tokens vs {len(ref.token_ids)}"
    for step, (a, b) in enumerate(zip(ours, ref.token_ids)):
        if a != b:
            lp = ref.step_logprobs[step]
            gap = abs(float(lp[a]) - float(lp[b]))
            assert gap <= NEAR_TIE, (f"{what}: token {step} is {a}, transformers {b}, not a "
                                     f"near-tie (logprob gap {gap:.2e}); ours {ours}, theirs "
                                     f"{ref.token_ids}")
            return


def assert_logprobs_close(ours: list, ref: Reference, num_top: int, what: str) -> None:
    """Sampled tokens' logprobs and the top-N alternatives, to 1e-4, until the first flip."""
    for step, entry in enumerate(ours):
        if entry.token_id != ref.token_ids[step]:
            return
        lp = ref.step_logprobs[step]
        assert abs(entry.logprob - float(lp[entry.token_id])) <= 1e-4, f"{what} step {step}"
        chosen = float(lp[entry.token_id])  # rank: exact up to ties within the tolerance
        assert int((lp > chosen + 1e-4).sum()) + 1 <= entry.rank <= int((lp >= chosen - 1e-4).sum())
        assert len(entry.top) == num_top
        for token, value in entry.top:
            assert abs(value - float(lp[token])) <= 1e-4, f"{what} step {step} top {token}"
        ref_top = set(lp.topk(num_top).indices.tolist())
        if abs(float(lp.topk(num_top + 1).values[-2] - lp.topk(num_top + 1).values[-1])) > NEAR_TIE:
            assert {t for t, _ in entry.top} == ref_top, f"{what} step {step} top-{num_top} set"
