"""One pipeline stage's share of a forward: receive the previous stage's (hidden, residual),
run this stage's layers, send them on; the last stage returns the final hidden states.

Every rank builds the same ModelInputs from the broadcast SchedulerOutput, so the receiving side
knows the shapes ([num_tokens, hidden]) without a header message.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.services.engine.distributed.parallel_state import ParallelContext
from shoal.services.engine.runner.input_batch import ModelInputs


def run_stage(model: nn.Module, inputs: ModelInputs, parallel: ParallelContext,
              dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    intermediate = None
    if not parallel.is_first_stage:
        shape = (inputs.input_ids.shape[0], int(model.hidden_size))
        hidden, residual = parallel.recv_prev([shape, shape], dtype, device)
        intermediate = (hidden, residual)
    out = model(inputs.input_ids, inputs.positions, inputs.meta, intermediate)
    if parallel.is_last_stage:
        assert isinstance(out, torch.Tensor)
        return out
    parallel.send_next(list(out))
    return None
