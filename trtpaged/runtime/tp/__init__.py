"""Tensor parallelism: one model over N ranks (processes) on torch.distributed.

Rank 0 owns the scheduler and block pool and decides each step; it broadcasts
the step batch and the block moves to the other ranks, every rank runs its
shard of the model over its own KV pool (its KV heads, the same block ids),
the row-parallel layers' partial outputs are all-reduced, and rank 0 samples.

- `rendezvous.py`: where the ranks meet (TCPStore) and their process groups;
- `messages.py`: the commands rank 0 broadcasts (step, block moves, stop);
- `worker.py`: the loop of ranks 1..N-1 (`python -m trtpaged.runtime.tp.worker`);
- `launch.py`: starting and stopping local worker processes;
- `runner.py`: `TensorParallelRunner`, rank 0's `ModelRunner`.
"""

from trtpaged.runtime.tp.rendezvous import Rendezvous, TensorParallelError
from trtpaged.runtime.tp.runner import TensorParallelRunner, start_tensor_parallel

__all__ = ["Rendezvous", "TensorParallelError", "TensorParallelRunner", "start_tensor_parallel"]
