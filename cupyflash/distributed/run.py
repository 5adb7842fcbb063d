"""Launcher: one process per GPU, with the NCCL id and the rank in the environment.

    python -m cupyflash.distributed.run --nproc 2 script.py [args...]
    python -m cupyflash.distributed.run --nproc 2 -m package.module [args...]

Every process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and the NCCL unique id
(CUPYFLASH_NCCL_ID, hex); ``cupyflash.distributed.init_process_group()`` turns them into
``(comm, rank, world)``. The launcher waits for all of them; when one fails it stops the others
(a rank blocked in NCCL would wait forever) and exits with the failed rank's status.

Several nodes: run the launcher once per node with ``--nnodes M --node-rank i`` and the same
``--id-file PATH`` on a file system all nodes see. Node 0 creates the id and writes it there
(atomically); the other nodes' ranks wait for it. NCCL's own environment (NCCL_SOCKET_IFNAME,
NCCL_IB_HCA, ...) chooses the network. Global rank = node_rank * nproc + local rank.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from .nccl import ID_ENV, ID_FILE_ENV


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m cupyflash.distributed.run",
        description="Start one process per GPU for cupyflash.distributed (NCCL).")
    p.add_argument("--nproc", type=int, required=True, help="processes (GPUs) on this node")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (default 0)")
    p.add_argument("--id", default=None, help="NCCL unique id as hex (default: made here)")
    p.add_argument("--id-file", default=None,
                   help="shared file for the id (several nodes): node 0 writes it, others read it")
    p.add_argument("-m", dest="module", default=None, help="run a module (like python -m)")
    p.add_argument("script", nargs="?", help="the script to run in every process")
    p.add_argument("args", nargs="*", help="its arguments")
    return p


_VALUED = ("--nproc", "--nnodes", "--node-rank", "--id", "--id-file")


def parse(argv):
    """The launcher's options, then the script (or ``-m module``) and its arguments untouched."""
    argv = list(argv)
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "-m":
            i += 2
            break
        if a in _VALUED:
            i += 2
        elif a.startswith("-") and a.split("=", 1)[0] in _VALUED or a in ("-h", "--help"):
            i += 1
        else:
            i += 1
            break
    else:
        i = len(argv)
    opts = _parser().parse_args(argv[:i])
    opts.args = argv[i:]
    return opts


def _write_id_file(path, uid):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(uid + "\n")
    os.replace(tmp, path)


def _id_env(opts) -> dict:
    """The environment entries that carry the NCCL id to the ranks of this node."""
    if opts.id:
        bytes.fromhex(opts.id)  # a clear error now rather than in every rank
        return {ID_ENV: opts.id}
    if opts.nnodes > 1 and not opts.id_file:
        raise SystemExit("--nnodes > 1 needs --id-file PATH on a shared file system (or --id HEX)")
    if opts.id_file and opts.node_rank != 0:
        return {ID_FILE_ENV: opts.id_file}
    from .nccl import unique_id_hex

    uid = unique_id_hex()
    if opts.id_file:
        _write_id_file(opts.id_file, uid)
    return {ID_ENV: uid}


def commands(opts):
    """(argv, env) of each process this node starts."""
    if opts.nproc < 1 or opts.nnodes < 1 or not 0 <= opts.node_rank < opts.nnodes:
        raise SystemExit(f"--nproc {opts.nproc} --nnodes {opts.nnodes} --node-rank "
                         f"{opts.node_rank}: need nproc >= 1, nnodes >= 1, 0 <= node-rank < nnodes")
    if opts.module:
        argv = [sys.executable, "-m", opts.module]
        rest = list(opts.args)
    else:
        if not opts.script:
            raise SystemExit("give a script to run (or -m module)")
        argv = [sys.executable, opts.script]
        rest = list(opts.args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    ident = _id_env(opts)
    world = opts.nproc * opts.nnodes
    out = []
    for local in range(opts.nproc):
        env = dict(os.environ, **ident)
        env.update(RANK=str(opts.node_rank * opts.nproc + local), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(opts.nproc))
        out.append((argv + rest, env))
    return out


def launch(opts, poll: float = 0.05, grace: float = 10.0) -> int:
    """Start the processes, wait for them; returns the exit status (the first failure's)."""
    procs = [subprocess.Popen(argv, env=env) for argv, env in commands(opts)]
    status = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                status = failed[0]
                break
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll)
    except KeyboardInterrupt:
        status = 130
    for p in procs:  # stop the ranks still running (ours, by their Popen handles)
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return status


def main(argv=None) -> int:
    return launch(parse(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
