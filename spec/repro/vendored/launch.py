"""How a standalone reproducer starts its own ranks: ``world`` copies of the file itself as subprocesses
(``--rank r <port> <folder>``), joined by the file into one gloo group over loopback TCP, each leaving its reply in a
temporary folder the parent reads. A rank still running 30 s after every rank replied is killed: on torch 2.4 a rank
can hang in gloo's ``destroy_process_group`` after its reply is written. Vendored into the data-parallel micro-batch
reproducer (:mod:`spec.repro.dp_layer`) and the real-rank reproducers (:mod:`spec.repro.ranks`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

#: the names the file binds for this module: none
BOUND = ()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world, reply_name, load):
    """Start this file once per rank; [load(reply of rank r)], or (None, what went wrong)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # modules as imported here
        procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--rank", str(r), str(port), out],
                                  env=env) for r in range(world)]
        start, replied = time.monotonic(), None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if replied is None and all(Path(out, reply_name.format(rank=r)).exists() for r in range(world)):
                replied = now
            if replied is not None and now - replied > 30:
                for p in procs:  # every rank replied; one hangs in gloo's destroy_process_group (seen on torch 2.4)
                    if p.poll() is None:
                        p.kill()
                break
            if now - start > 300:
                for p in procs:
                    p.kill()
                return None, "the ranks did not finish within 300 s (one waits in a collective the others never join?)"
            time.sleep(0.05)
        codes = [p.wait() for p in procs]
        replies = []
        for r in range(world):
            reply = Path(out, reply_name.format(rank=r))
            if not reply.exists():
                return None, f"rank {r} exited {codes[r]} without a reply"
            replies.append(load(reply))
    return replies, None


def join_group(rank, world, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
