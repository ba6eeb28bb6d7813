"""Tensor and pipeline parallelism: a model split across processes on torch.distributed (gloo).

``shard`` (each tensor-parallel rank's part of a layer), ``stages`` (each pipeline stage's
layers), ``all_reduce`` and ``channels`` (shared memory on one host, gloo across hosts),
``placement`` (which rank a process is, and its cores), ``group`` (starting and joining the
ranks, rank 0's commands, failures), ``driver`` (rank 0's runner), ``rank`` (a rank's part of
a step, the other ranks' loop) and ``rank_main`` (their entry point). See docs/parallel.md.
"""
