"""Context parallelism: ring attention over sequence shards, forward and backward.

    from cupyflash.distributed import ring_attention, shard, init_process_group
    comm, rank, world = init_process_group()          # under python -m cupyflash.distributed.run
    q_r = shard(q, rank, world, scheme="zigzag")       # this rank's rows of the sequence
    out_r = ring_attention(q_r, k_r, v_r, comm, causal=True, scheme="zigzag")

Simulated ranks in one process (NumPy on the CPU, or CuPy on one GPU) for tests:

    outs = ring_attention(qs, ks, vs, InProcessTransport(world), causal=True)   # lists per rank

Importing this package needs neither CuPy nor NCCL; they are imported when a GPU path runs.
"""
from .nccl import init_process_group
from .ring import ring_attention, ring_attention_backward, ring_attention_vjp
from .sharding import shard, shard_lengths, unshard
from .transport import InProcessTransport, NcclTransport, Shift, Transport

__all__ = [
    "ring_attention",
    "ring_attention_backward",
    "ring_attention_vjp",
    "shard",
    "shard_lengths",
    "unshard",
    "init_process_group",
    "InProcessTransport",
    "NcclTransport",
    "Shift",
    "Transport",
]
