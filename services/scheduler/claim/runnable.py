"""What no fleet can ever run: a deployment whose settings the model itself refuses. A tp its heads
cannot split, a pp beyond its layers, tp / pp for an encoder (one rank), a max_model_len beyond
its context. Each is an InvalidRequest naming the ModelSpec field, with the engine's own words
(services/engine/model_limits.py owns the rules): the dry run and a deploy refuse it with a 400,
and a reconcile pass keeps such an instance PENDING with the reason instead of starting an engine
that would fail the same way at every restart.
"""

from __future__ import annotations

from shoal.services.engine import ConfigError, check_parallel_sizes, resolve_max_model_len
from shoal.services.scheduler.claim.profile import ModelProfile, ModelShape
from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.registry import ModelSpec

SPEC_FIELDS = {"tensor_parallel_size": "tp", "pipeline_parallel_size": "pp"}
"""The engine's names of the sizes -> the ModelSpec fields that set them."""


def parallel_problem(s: ModelShape, tp: int, pp: int) -> InvalidRequest | None:
    """Why (tp, pp) cannot split the model, as an error naming `tp` or `pp`; None when it can."""
    if not s.is_causal_lm and tp * pp > 1:
        field = "tp" if tp > 1 else "pp"
        return InvalidRequest(f"{field}={tp if tp > 1 else pp} cannot work: an embedding model "
                              f"({s.architecture}) runs as one rank; deploy it without tp / pp",
                              param=field)
    try:
        check_parallel_sizes(s.architecture, s.num_attention_heads, s.num_kv_heads,
                             s.mlp_split_size, s.num_layers, tp, pp)
    except ConfigError as exc:
        field = SPEC_FIELDS.get(exc.param or "", "tp")
        value = tp if field == "tp" else pp
        return InvalidRequest(f"{field}={value} cannot work: {exc.message}", param=field)
    return None


def check_runnable(spec: ModelSpec, profile: ModelProfile) -> None:
    """InvalidRequest naming the field of `spec` that the model can never run with."""
    if spec.tp is not None or spec.pp is not None:
        problem = parallel_problem(profile.shape, spec.tp or 1, spec.pp or 1)
        if problem is not None:
            raise problem
    try:
        resolve_max_model_len(spec.max_model_len, profile.shape.context_limit)
    except ConfigError as exc:
        raise InvalidRequest(exc.message, param="max_model_len") from None
