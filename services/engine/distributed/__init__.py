"""Tensor and pipeline parallelism for the engine (torch.distributed: gloo on CPU, NCCL on CUDA).

parallel_state.py: a rank's place (tp/pp rank, its groups) and the shape checks; layers.py has no
torch.distributed of its own: the model layers call the collectives through a `ParallelContext`.
executor.py: the driver (rank 0, in the engine's process) broadcasts each SchedulerOutput and
every rank runs the same step; worker.py is the loop of the other ranks.
"""
