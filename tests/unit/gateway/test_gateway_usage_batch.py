"""The gateway's usage batch: one record per key and model, sums of every count."""

from __future__ import annotations

from shoal.services.gateway.auth.quota import UsageBatch
from shoal.shared.schemas.registry import UsageRecord


def test_a_batch_sums_per_key_and_model_and_empties_when_taken() -> None:
    batch = UsageBatch()
    for key, model, tokens in (("a", "m", 3), ("a", "m", 4), ("a", "n", 5), ("b", "m", 6)):
        batch.add(UsageRecord(key_id=key, model=model, prompt_tokens=tokens, cached_tokens=1,
                              output_tokens=2 * tokens))
    assert batch.num_requests == 4
    rows = {(r.key_id, r.model): r for r in batch.take()}
    assert set(rows) == {("a", "m"), ("a", "n"), ("b", "m")}
    am = rows["a", "m"]
    assert (am.requests, am.prompt_tokens, am.cached_tokens, am.output_tokens) == (2, 7, 2, 14)
    assert rows["b", "m"].requests == 1
    assert batch.take() == [] and batch.num_requests == 0
