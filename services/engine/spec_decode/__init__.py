"""Speculative decoding (docs/engine-core.md "Speculative decoding"): proposers that guess the
next tokens cheaply, and the verification of those guesses in the target's one forward.

The scheduler only reserves slots (`ScheduledSeq.num_spec_tokens`); the runner fills them with
a proposer's drafts, verifies them (greedy match or rejection sampling) and returns the accepted
ones (`RunnerOutput.spec_token_ids`), so no draft ever crosses into scheduler state unverified.
"""
