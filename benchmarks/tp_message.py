"""What it costs to bring a step's StepInputs from rank 0 to a tensor-parallel worker (CPU): a
pipe (pickle, send, the worker unpickles and answers one byte: a round trip; what
executor/executor.py uses) against a gloo broadcast_object_list; decode steps at batch 1 and 256,
each sequence 1,024 tokens in (64 blocks of 16).

Usage: python benchmarks/tp_message.py"""

import multiprocessing
import socket
import time

import numpy as np


def step(batch):
    from picovllm.messages import StepInputs

    tables = [list(range(i * 64, i * 64 + 64)) for i in range(batch)]
    ones = np.ones(batch, dtype=np.int64)
    return StepInputs([[7] for _ in range(batch)], np.full(batch, 1024), ones, tables, np.ones(batch, dtype=bool))


N = 300


def pipe_peer(conn):
    while conn.recv() is not None:
        conn.send(1)


def gloo_peer(port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1)
    obj = [None]
    while True:
        dist.broadcast_object_list(obj, src=0)
        if obj[0] is None:
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=pipe_peer, args=(b,))
    p.start()
    for batch in (1, 256):
        s = step(batch)
        for _ in range(20):
            a.send(("step", s, 0))
            a.recv()
        t = time.perf_counter()
        for _ in range(N):
            a.send(("step", s, 0))
            a.recv()
        print(f"pipe  batch {batch:3d}: {(time.perf_counter() - t) / N * 1e6:7.1f} us per step")
    a.send(None)
    p.join()
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    q = ctx.Process(target=gloo_peer, args=(port,))
    q.start()
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0)
    for batch in (1, 256):
        s = step(batch)
        for _ in range(20):
            dist.broadcast_object_list([("step", s, 0)], src=0)
        t = time.perf_counter()
        for _ in range(N):
            dist.broadcast_object_list([("step", s, 0)], src=0)
        print(f"gloo  batch {batch:3d}: {(time.perf_counter() - t) / N * 1e6:7.1f} us per step")
    dist.broadcast_object_list([None], src=0)
    q.join()
    dist.destroy_process_group()
