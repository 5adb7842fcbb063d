"""Ring attention across GPUs (or simulated ranks), checked against one call on the whole sequence.

One process per GPU, over NCCL:

    python -m cupyflash.distributed.run --nproc 2 examples/ring_attention.py

Simulated ranks in one process (NumPy on the CPU, or CuPy on one GPU with --gpu):

    python examples/ring_attention.py --simulate 4
    python examples/ring_attention.py --simulate 4 --gpu

Every rank draws the same whole sequence (same seed), keeps its zigzag shard, runs the ring
forward and backward, and compares its rows with cupyflash.attention / attention_backward on the
whole sequence.
"""
import argparse

import numpy as np

import cupyflash as cf
from cupyflash.distributed import (InProcessTransport, init_process_group, ring_attention,
                                   ring_attention_backward, shard, unshard)


def whole_problem(args, xp):
    rng = np.random.default_rng(args.seed)
    shape = (1, args.seqlen, args.heads, args.head_dim)
    dtype = np.float64 if xp is np else np.float32
    arrays = [rng.standard_normal(shape).astype(dtype) for _ in range(4)]   # q, k, v, dout
    if xp is not np:
        import ml_dtypes
        arrays = [xp.asarray(a).astype(ml_dtypes.bfloat16) for a in arrays]
    return arrays


def max_err(a, b):
    a, b = (np.asarray(x.get() if hasattr(x, "get") else x, np.float64) for x in (a, b))
    fin = np.isfinite(b)
    return float(np.abs(a[fin] - b[fin]).max())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--simulate", type=int, default=0, help="simulated ranks in this process")
    p.add_argument("--gpu", action="store_true", help="with --simulate: CuPy on one GPU")
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--full", action="store_true", help="no causal mask")
    args = p.parse_args()
    causal, scheme = not args.full, "zigzag"

    if args.simulate:
        world = args.simulate
        if args.gpu:
            import cupy as xp
        else:
            xp = np
            args.seqlen = min(args.seqlen, 512)   # the CPU implementation: keep it quick
        q, k, v, do = whole_problem(args, xp)
        comm = InProcessTransport(world)
        qs, ks, vs, dos = ([shard(x, r, world, scheme=scheme) for r in range(world)]
                           for x in (q, k, v, do))
        outs, lses = ring_attention(qs, ks, vs, comm, causal=causal, scheme=scheme, return_lse=True)
        grads = ring_attention_backward(dos, qs, ks, vs, outs, lses, comm, causal=causal,
                                        scheme=scheme)
        out = unshard(outs, scheme=scheme)
        dq, dk, dv = (unshard([g[i] for g in grads], scheme=scheme) for i in range(3))
        rank = "all"
    else:
        import cupy as xp
        comm, rank, world = init_process_group()
        q_all, k_all, v_all, do_all = whole_problem(args, xp)
        q, k, v, do = (shard(x, rank, world, scheme=scheme) for x in (q_all, k_all, v_all, do_all))
        out, lse = ring_attention(q, k, v, comm, causal=causal, scheme=scheme, return_lse=True)
        dq, dk, dv = ring_attention_backward(do, q, k, v, out, lse, comm, causal=causal,
                                             scheme=scheme)
        q, k, v, do = q_all, k_all, v_all, do_all

    ref_out, ref_lse = cf.attention(q, k, v, causal=causal, return_lse=True)
    ref = (ref_out,) + tuple(cf.attention_backward(do, q, k, v, ref_out, ref_lse, causal=causal))
    if not args.simulate:   # this rank's rows only
        ref = tuple(shard(x, rank, world, scheme=scheme) for x in ref)
    errs = [max_err(g, r) for g, r in zip((out, dq, dk, dv), ref)]
    print(f"rank {rank} of {world} ({scheme}, causal={causal}, seqlen {args.seqlen}, "
          f"{np.dtype(q.dtype).name}): max |ring - single call| out {errs[0]:.2e} "
          f"dq {errs[1]:.2e} dk {errs[2]:.2e} dv {errs[3]:.2e}", flush=True)


if __name__ == "__main__":
    main()
