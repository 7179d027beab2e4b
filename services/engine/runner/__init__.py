"""The model side of a step: `ModelRunner` owns the model, the KV tensors and the sampling state,
and turns each SchedulerOutput into a RunnerOutput with one forward (torch lives here, in the
models, layers, kernels and distributed folders, never in core/)."""
