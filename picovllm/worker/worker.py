"""One tensor-parallel rank other than 0, in a process of its own: its device, its shard of the
model and of the KV cache, and a model runner that runs every step's forward as rank 0 sends it
(executor/executor.py). Rank 0, which samples, runs in the engine's process.

Messages from rank 0, on a pipe: ("kv", num_blocks, num_host_blocks) allocates the KV pools, ("step", StepInputs,
num_pending) runs a forward, None stops. The worker says ("joining", None) as it joins the
process group, ("ready", num_kv_blocks) once its model is loaded, and ("error", message) before
it exits on an exception.
"""

from __future__ import annotations

import contextlib
import os
import signal

import torch

from picovllm import envs
from picovllm.config import EngineConfig, resolve_device, resolve_dtype
from picovllm.distributed.parallel_state import check_torchrun_world, destroy_distributed, init_distributed


def worker_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r's device: GPU r (modulo the GPUs there are), or the CPU."""
    device = resolve_device(config.device)
    if device.type == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return device


def _model_runner(config: EngineConfig, device: torch.device, max_model_len: int):
    """This rank's shard of the model, in a model runner (it never samples: no EOS ids)."""
    from picovllm.model.loader.model_loader import resolve_model
    from picovllm.worker.model_runner import ModelRunner

    model_config, path = resolve_model(config.model)
    torch.manual_seed(config.seed)
    dtype = resolve_dtype(config.dtype, model_config.torch_dtype)
    return ModelRunner(config, model_config, path, dtype, device, max_model_len, set())


def _follow(runner, recv, reply=None) -> None:
    """Run rank 0's messages until its None: ("kv", num_blocks, num_host_blocks), ("graphs", max_num_seqs,
    max_model_len, mixed_graph_tokens), ("step", StepInputs, num_pending); a prefill or decode
    instance's ("kv_info",), ("kv_pull", pull_id, remote, remote_blocks, local_blocks, after) and
    ("kv_poll",), the first and last answered through reply. The graphs are freed before the
    process group is (a graph holding NCCL's work hung at exit otherwise)."""
    try:
        while (msg := recv()) is not None:
            kind = msg[0]
            if kind == "step":
                runner.step_logits(msg[1], None, msg[2])
            elif kind == "kv":
                runner.allocate_kv_cache(*msg[1:])
            elif kind == "graphs":
                runner.capture_graphs(*msg[1:])
            elif kind == "kv_pull":
                runner.kv_transfer.pull(*msg[1:])
            else:
                reply((kind, runner.kv_transfer.rank_info() if kind == "kv_info" else runner.kv_transfer.poll()))
    finally:
        runner.free_graphs()
        if runner.kv_transfer is not None:
            runner.kv_transfer.close()


def _stopping(conn) -> bool:
    """Whether rank 0's next message is its None (stop), or rank 0 is gone."""
    try:
        return conn.poll(0) and conn.recv() is None
    except (EOFError, OSError):
        return True


def worker_main(
    rank: int, world_size: int, init_method: str, backend: str, engine_args: dict, max_model_len: int, conn
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops the workers
    try:
        config = EngineConfig(**engine_args)
        device = worker_device(config, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        conn.send(("joining", None))  # (rank 0 joins the process group once every worker is this far)
        init_distributed(world_size, rank, backend, init_method)
        runner = _model_runner(config, device, max_model_len)
        conn.send(("ready", runner.num_kv_blocks(config)))
        _follow(runner, conn.recv, conn.send)
    except EOFError:  # rank 0 went away
        return
    except BaseException as e:
        if _stopping(conn):  # rank 0 left the process group mid-step, and said so: not a failure
            return
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(e).__name__}: {e}"))
        raise
    finally:
        destroy_distributed()


def torchrun_worker(engine_args: dict) -> int:
    """Rank r > 0 of a torchrun launch (every rank runs the same command: rank 0 is the engine, and
    sends its engine's config, which this rank then follows; its own options name the device and
    the world): the same model runner, its messages from rank 0 over a BroadcastChannel; returns
    at rank 0's None (one engine a launch). Its failures end the process, and torchrun the others."""
    from picovllm.distributed.communicator import BroadcastChannel

    rank, world_size, local_rank = envs.torchrun_ranks()
    config = EngineConfig(**engine_args)
    config.validate()
    check_torchrun_world(world_size, config.tensor_parallel_size)
    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    init_distributed(world_size, rank, "nccl" if device.type == "cuda" else "gloo")
    try:
        channel = BroadcastChannel()
        engine_args, max_model_len = channel.recv()
        config = EngineConfig(**engine_args)
        runner = _model_runner(config, device, max_model_len)
        channel.min(runner.num_kv_blocks(config))
        _follow(runner, channel.recv)
    finally:
        destroy_distributed()
    return 0
