"""KVTransfer's backend: one NIXL agent per pool, one-sided READs over UCX, host or GPU memory,
across processes and machines; between two GPU pools of one machine the blocks go through CUDA
IPC instead (cuda_ipc.py), when the peer's handle opens here, and NIXL still carries the
notices. A dead peer fails the pulls from it (their ids come back from poll as failed); nothing
waits on it. A pull into blocks that a step launched ahead may still be writing (they were
freed under it) starts after the work already queued on this pool's device.

A pull is one descriptor per layer, K/V and run of consecutive block ids on both sides; one that
reshards heads (other tensor-parallel sizes) is one per layer, K/V and block.
"""

from __future__ import annotations

import base64
import os
import threading
import uuid

import numpy as np
import torch

from picovllm.distributed.kv_transfer.base import KVTransfer, KVTransferError, LeaseNotice, block_runs
from picovllm.distributed.kv_transfer.cuda_ipc import CudaIpcCopier


def nixl_api():
    """NIXL's Python API: the `nixl` meta package, else the CUDA 13 or CUDA 12 wheel itself."""
    for module in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return __import__(module, fromlist=["nixl_agent"])
        except ImportError:
            continue
    raise ModuleNotFoundError(
        "KV transfer needs NIXL: pip install nixl-cu12==1.5.1 (or nixl-cu13, or the nixl meta package)"
    )


# NIXL's Python API starts the UCX progress thread with no pause between its polls: a core busy per
# agent, idle or not. The thread waits on the worker's events and wakes at least this often.
_PROGRESS_POLL_US = 10_000
_agent_lock = threading.Lock()


def _nixl_agent(api, name: str):
    """A NIXL agent whose progress thread sleeps between events (see _PROGRESS_POLL_US)."""
    bind = api.nixlBind
    real = bind.nixlAgent

    def agent(agent_name, config):
        config.pthrDelay = _PROGRESS_POLL_US
        return real(agent_name, config)

    with _agent_lock:  # (the binding's constructor, wrapped while this agent is made)
        bind.nixlAgent = agent
        try:
            return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        finally:
            bind.nixlAgent = real


class NixlKVTransfer(KVTransfer):
    """One rank's pool. Its agent_info is {"ranks": [this rank's]}; the executor of a
    tensor-parallel instance joins its ranks' (Executor.kv_transfer). A pull from such a list
    takes this rank's KV heads from the ranks that hold them: whole blocks from a rank with the
    same heads, else each block's run of shared heads (rank r holds heads [first_head,
    first_head + num_heads) of every layer; with more ranks than KV heads a head is on several
    ranks, and the first is read)."""

    def __init__(self, first_head: int = 0, name: str | None = None, cuda_ipc: bool = True):
        api = nixl_api()
        if not torch.cuda.is_available():  # host memory: UCX's shared-memory transports failed here, TCP works
            os.environ.setdefault("UCX_TLS", "tcp")
        self.name = name or f"picovllm-{uuid.uuid4().hex[:12]}"
        self.agent = _nixl_agent(api, self.name)
        self.first_head = first_head
        self.kv: torch.Tensor | None = None
        self._info: dict | None = None  # (rank_info, once registered)
        self.peers: set[str] = set()  # remote agents added (by name)
        self.pulls: dict[str, list] = {}  # pull id -> its NIXL transfer handles (one a remote rank)
        self.waiting: dict[str, torch.cuda.Event] = {}  # pull id -> the work its NIXL transfers start after
        self.failed: dict[str, str] = {}  # pull id -> why, reported once nothing of it is in flight
        self.active: set[str] = set()  # pulls started, not reported by poll yet
        self.cuda_ipc = cuda_ipc  # (pull through CUDA IPC where it works)
        self.ipc: CudaIpcCopier | None = None  # (a GPU pool's)

    def register(self, kv_cache: torch.Tensor) -> None:
        assert kv_cache.is_contiguous() and kv_cache.dim() == 6
        self.kv = kv_cache
        self.mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self.device_id = kv_cache.device.index or 0
        self._registration = self.agent.register_memory(kv_cache)
        if kv_cache.is_cuda:
            self.ipc = CudaIpcCopier(kv_cache, self.first_head)

    def rank_info(self) -> dict:
        if self._info is None:
            self._info = self._describe()
        return self._info

    def _describe(self) -> dict:
        layers, _, blocks, heads, block_size, head_dim = self.kv.shape
        return {
            "agent": self.name,
            "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "base": self.kv.data_ptr(),
            "device_id": self.device_id,
            "mem_type": self.mem_type,
            **(self.ipc.describe() if self.ipc is not None else {"cuda_ipc": None}),
            "num_layers": layers,
            "num_blocks": blocks,
            "block_size": block_size,
            "first_head": self.first_head,
            "num_heads": heads,
            "head_bytes": head_dim * self.kv.element_size(),
        }

    def agent_info(self) -> dict:
        return {"ranks": [self.rank_info()]}

    def _peer(self, remote: dict) -> str:
        name = remote["agent"]
        if name not in self.peers:
            self.agent.add_remote_agent(base64.b64decode(remote["metadata"]))
            self.peers.add(name)
        return name

    def _sources(self, ranks: list[dict]) -> list[tuple[dict, int, int]]:
        """(remote rank, first head, end head) for each run of this rank's heads, and who holds it."""
        mine = self.rank_info()
        lo, end, sources = mine["first_head"], mine["first_head"] + mine["num_heads"], []
        for r in ranks:
            if r["num_layers"] != mine["num_layers"] or r["head_bytes"] != mine["head_bytes"]:
                raise KVTransferError(f"the remote KV layout {_shape(r)} does not match this pool's {_shape(mine)}")
            if r["block_size"] != mine["block_size"]:
                raise KVTransferError(f"remote block size {r['block_size']}, this pool's {mine['block_size']}")
            start, stop = max(lo, r["first_head"]), min(end, r["first_head"] + r["num_heads"])
            if start == lo and start < stop:
                sources.append((r, start, stop))
                lo = stop
        if lo < end:
            raise KVTransferError(f"no remote rank holds KV heads {lo}..{end - 1}")
        return sources

    def pull(self, pull_id, remote: dict, remote_blocks: list[int], local_blocks: list[int], after=False) -> None:
        """With `after`, on a GPU: the CUDA IPC copies wait on the copy stream for the work queued
        on the current stream, and the NIXL transfers start at the first poll after it ended."""
        self.active.add(pull_id)
        handles = []
        ready = None
        if self.kv.is_cuda and after:
            ready = torch.cuda.Event()
            ready.record()
        try:
            for r, lo, hi in self._sources(remote["ranks"]):
                mapped = self.ipc.peer_pool(r) if self.ipc is not None and self.cuda_ipc else None
                if mapped is not None:
                    self.ipc.copy(pull_id, mapped, r, lo, hi, remote_blocks, local_blocks, ready)
                    continue
                peer = self._peer(r)
                local, far = self._descs(r, lo, hi, remote_blocks, local_blocks)
                handles.append(
                    self.agent.initialize_xfer(
                        "READ",
                        self.agent.get_xfer_descs(local, self.mem_type),
                        self.agent.get_xfer_descs(far, r["mem_type"]),
                        peer,
                    )
                )
            if handles and (ready is None or ready.query()):
                self._start(handles)
            elif handles:
                self.waiting[pull_id] = ready
        except Exception as e:  # (NIXL's errors, a peer gone: the pull fails, the engine goes on)
            self.failed[pull_id] = f"{type(e).__name__}: {e}"
            self.waiting.pop(pull_id, None)
        if handles:  # (a failed pull too: what it started may still be writing the blocks)
            self.pulls[pull_id] = handles

    def _start(self, handles: list) -> None:
        for handle in handles:
            if self.agent.transfer(handle) == "ERR":
                raise KVTransferError("the transfer could not start")

    def _descs(self, r: dict, lo: int, hi: int, remote_blocks, local_blocks) -> tuple[np.ndarray, np.ndarray]:
        """[N, 3] (address, bytes, device) on both sides: heads [lo, hi) of every layer's K and V of
        the blocks; one descriptor per run of consecutive blocks when both hold just those heads,
        else one per block."""
        mine = self.rank_info()
        runs = np.array(block_runs(remote_blocks, local_blocks), dtype=np.int64).reshape(-1, 3)
        planes = np.arange(2 * mine["num_layers"], dtype=np.int64)[:, None]

        whole = mine["num_heads"] == r["num_heads"] == hi - lo
        out = []
        for info, col in ((mine, 1), (r, 0)):  # (columns of runs: remote start, local start, count)
            base, nblocks = info["base"], info["num_blocks"]
            head = info["head_bytes"] * info["block_size"]  # (one head's tokens of a block)
            block = head * info["num_heads"]
            if whole:
                addr = base + (planes * nblocks + runs[None, :, col]) * block
                size = np.broadcast_to(runs[None, :, 2] * block, addr.shape)
            else:  # each block: its run of heads
                blocks = np.concatenate([np.arange(s, s + n) for s, n in zip(runs[:, col], runs[:, 2])])
                addr = base + (planes * nblocks + blocks[None, :]) * block + (lo - info["first_head"]) * head
                size = np.full(addr.shape, (hi - lo) * head)
            device = np.full(addr.size, info["device_id"], dtype=np.int64)
            out.append(np.stack([addr.ravel(), np.ravel(size), device], axis=1).astype(np.uint64))
        return out[0], out[1]

    def poll(self) -> tuple[list[str], dict[str, str]]:
        """A pull ends when none of its CUDA IPC copies and NIXL transfers is in flight; it failed
        if any of them did (or it could not start)."""
        copying = self.ipc.in_flight() if self.ipc is not None else set()
        for pull_id, ready in list(self.waiting.items()):
            if ready.query():
                del self.waiting[pull_id]
                try:
                    self._start(self.pulls[pull_id])
                except Exception as e:
                    self.failed[pull_id] = f"{type(e).__name__}: {e}"
        for pull_id, handles in list(self.pulls.items()):
            if pull_id in self.waiting:
                continue
            states = []
            for handle in handles:
                try:
                    states.append(self.agent.check_xfer_state(handle))
                except Exception as e:
                    states.append(f"{type(e).__name__}: {e}")
            if "PROC" in states:
                continue
            del self.pulls[pull_id]
            for handle in handles:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception:
                    pass
            bad = [s for s in states if s != "DONE"]
            if bad:
                self.failed.setdefault(pull_id, "the transfer failed" if bad[0] == "ERR" else bad[0])
        done, failed = [], {}
        for pull_id in [p for p in self.active if p not in self.pulls and p not in copying]:
            self.active.discard(pull_id)
            if pull_id in self.failed:
                failed[pull_id] = self.failed.pop(pull_id)
            else:
                done.append(pull_id)
        return done, failed

    def stats(self) -> dict[str, int]:
        return {"kv_transfers_cuda_ipc": self.ipc.num_pulls if self.ipc is not None else 0}

    def notify(self, remote: dict, notice: LeaseNotice) -> None:
        try:
            self.agent.send_notif(self._peer(remote["ranks"][0]), notice.encode())
        except Exception:  # the peer is gone: its leases end by themselves
            pass

    def notices(self) -> list[LeaseNotice]:
        got = []
        for messages in self.agent.get_new_notifs().values():
            got += [n for m in messages if (n := LeaseNotice.decode(m)) is not None]
        return got

    def close(self) -> None:
        if self.ipc is not None:
            self.ipc.close()
        for handles in self.pulls.values():  # (a pull still writing into the pool must end before the pool goes)
            for handle in handles:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception:
                    pass
        self.pulls.clear()
        self.waiting.clear()
        self.active.clear()
        if self.kv is not None:
            self.agent.deregister_memory(self._registration)
            self.kv = None


def _shape(info: dict) -> dict:
    return {k: info[k] for k in ("num_layers", "num_heads", "head_bytes", "block_size")}
