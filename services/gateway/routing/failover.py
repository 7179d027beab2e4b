"""Mid-stream failover (issue 32, item 3), the pure half: what a stream has delivered, whether it
may go on elsewhere, and the request that continues it.

When the engine serving a started stream dies, InferClient sends the same request to another
replica with `resume`: the tokens and text of choice 0 its client already has. That engine
treats them as output already generated (max_tokens, min_tokens, penalties and stop strings
carry on; a seeded generator is advanced past them) and streams only what follows, so the
client sees one stream, and a greedy or seeded one is token for token what an undisturbed run
gives. Only such requests move: sampling without a seed would not be the same request, n > 1
and structured outputs are not resumed (the engine refuses them), and the replies of the new
engine's acceptance (seq 0) are not passed on. The usage is the original request's: its prompt
once, and every token delivered.
"""

from __future__ import annotations

from shoal.shared.schemas.infer import GenerateRequest, InferChunk, InferEnd, Resume, Usage


class Failover:
    def __init__(self, req: GenerateRequest) -> None:
        self.req = req
        self.token_ids: list[int] = list(req.resume.token_ids) if req.resume else []
        self.text = req.resume.text if req.resume else ""
        self.prompt_tokens: int | None = None
        self.moves = 0
        """How many times the stream moved to another replica."""

    def refusal(self) -> str | None:
        """Why this request cannot move to another replica (a metric label), None if it can."""
        sampling = self.req.sampling
        if sampling.n != 1:
            return "n_above_1"
        if sampling.structured_outputs is not None:
            return "structured_output"
        if sampling.temperature != 0 and sampling.seed is None:
            return "not_reproducible"
        return None

    def resumed(self) -> GenerateRequest:
        """The request that continues the stream elsewhere (its prompt logprobs were sent)."""
        self.moves += 1
        return self.req.model_copy(update={
            "resume": Resume(token_ids=list(self.token_ids), text=self.text),
            "sampling": self.req.sampling.model_copy(update={"prompt_logprobs": None})})

    def seen(self, reply: InferChunk | InferEnd) -> InferChunk | InferEnd | None:
        """Note what the client gets; None for a reply it must not see (a resumed stream's
        acceptance), and the end's usage as the original request's."""
        if isinstance(reply, InferChunk):
            if reply.seq == 0 and self.moves:
                return None
            if reply.prompt_token_ids is not None and self.prompt_tokens is None:
                self.prompt_tokens = len(reply.prompt_token_ids)
            for choice in reply.choices:
                if choice.index == 0:
                    self.token_ids.extend(choice.token_ids)
                    self.text += choice.text
            return reply
        if not self.moves:
            return reply
        usage = reply.usage
        prompt = self.prompt_tokens if self.prompt_tokens is not None else usage.prompt_tokens
        return reply.model_copy(update={"usage": Usage(  # (the last engine's cache hits)
            prompt_tokens=prompt, completion_tokens=len(self.token_ids),
            cached_tokens=min(usage.cached_tokens, prompt))})
