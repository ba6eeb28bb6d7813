"""Tensor parallelism: a model's layers split across processes on torch.distributed (gloo).

``shard`` (what each rank holds), ``all_reduce`` (shared memory on one host, gloo across hosts),
``placement`` (which rank a process is, and its cores), ``group`` (starting and joining the
ranks, rank 0's commands, failures), ``driver`` (rank 0's runner), ``rank`` (the other ranks'
loop) and ``rank_main`` (their entry point). See docs/parallel.md.
"""
