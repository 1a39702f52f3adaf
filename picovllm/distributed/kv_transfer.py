"""KV transfer between instances (disaggregated prefill): a decode instance pulls the KV blocks of a
prompt that a prefill instance computed, straight from that instance's pool into its own.

KVTransfer is what the engine's side (engine/kv_handoff.py) calls, through the rank that holds
the pool: register the pool, describe it to peers (agent_info, JSON), pull remote blocks into
local ones, poll the pulls, and release a peer's blocks once they are pulled (the peer sees the
release in `released`). NixlKVTransfer is its backend: one NIXL agent per pool, one-sided READs
over UCX, host or GPU memory, across processes and machines. A dead peer fails the pulls from it
(their ids come back from poll as failed); nothing waits on it.

The pool is the model runner's [layers, 2, num_blocks, block_size, kv_heads, head_dim] tensor:
a block of one layer's K (or V) is contiguous, so a pull is one descriptor per layer, K/V and
run of consecutive block ids on both sides.
"""

from __future__ import annotations

import base64
import itertools
import os
import uuid
from abc import ABC, abstractmethod

import torch


class KVTransferError(RuntimeError):
    pass


class KVTransfer(ABC):
    @abstractmethod
    def register(self, kv_cache: torch.Tensor) -> None:
        """The KV pool peers will read from and this side pulls into."""

    @abstractmethod
    def agent_info(self) -> dict:
        """What a peer needs to pull from this pool (JSON: it travels in kv_transfer_params)."""

    @abstractmethod
    def pull(self, pull_id: str, remote: dict, remote_blocks: list[int], local_blocks: list[int]) -> None:
        """Start copying the remote pool's blocks into ours (remote_blocks[i] -> local_blocks[i])."""

    @abstractmethod
    def poll(self) -> tuple[list[str], dict[str, str]]:
        """The pulls that completed since the last call, and those that failed (id -> why)."""

    @abstractmethod
    def release(self, remote: dict, request_id: str) -> None:
        """Tell the remote side that its request's blocks are no longer needed here."""

    @abstractmethod
    def released(self) -> list[str]:
        """The request ids whose blocks peers released since the last call."""

    @abstractmethod
    def close(self) -> None:
        """End the pulls in flight and unregister the pool."""


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


_RELEASE = b"release:"


class NixlKVTransfer(KVTransfer):
    def __init__(self, name: str | None = None):
        api = nixl_api()
        if not torch.cuda.is_available():  # host memory: UCX's shared-memory transports failed here, TCP works
            os.environ.setdefault("UCX_TLS", "tcp")
        self.name = name or f"picovllm-{uuid.uuid4().hex[:12]}"
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(backends=["UCX"]))
        self.kv: torch.Tensor | None = None
        self.peers: dict[str, str] = {}  # peer name -> its agent name in NIXL (added once)
        self.pulls: dict[str, object] = {}  # pull id -> transfer handle
        self.failed: dict[str, str] = {}

    def register(self, kv_cache: torch.Tensor) -> None:
        assert kv_cache.is_contiguous() and kv_cache.dim() == 6
        self.kv = kv_cache
        self.mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self.device_id = kv_cache.device.index or 0
        self._registration = self.agent.register_memory(kv_cache)

    def _layout(self) -> dict:
        layers, _, blocks = self.kv.shape[:3]
        return {
            "num_layers": layers,
            "num_blocks": blocks,
            "block_bytes": self.kv[0, 0, 0].numel() * self.kv.element_size(),
        }

    def agent_info(self) -> dict:
        return {
            "agent": self.name,
            "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "base": self.kv.data_ptr(),
            "device_id": self.device_id,
            "mem_type": self.mem_type,
            **self._layout(),
        }

    def _peer(self, remote: dict) -> str:
        name = remote["agent"]
        if name not in self.peers:
            self.peers[name] = self.agent.add_remote_agent(base64.b64decode(remote["metadata"]))
        return name

    def _descs(self, base: int, layout: dict, device_id: int, runs: list[tuple[int, int]]) -> list[tuple]:
        """(address, bytes, device) of each (layer, K/V, run of `count` blocks from `start`)."""
        size, planes, per_plane = layout["block_bytes"], 2 * layout["num_layers"], layout["num_blocks"]
        return [
            (base + (plane * per_plane + start) * size, count * size, device_id)
            for plane, (start, count) in itertools.product(range(planes), runs)
        ]

    def pull(self, pull_id: str, remote: dict, remote_blocks: list[int], local_blocks: list[int]) -> None:
        try:
            layout = self._layout()
            theirs = {k: remote[k] for k in layout}
            if theirs["num_layers"] != layout["num_layers"] or theirs["block_bytes"] != layout["block_bytes"]:
                raise KVTransferError(f"the remote KV layout {theirs} does not match this pool's {layout}")
            peer = self._peer(remote)
            runs = _runs(remote_blocks, local_blocks)
            local = self._descs(self.kv.data_ptr(), layout, self.device_id, [(lo, n) for _, lo, n in runs])
            far = self._descs(remote["base"], theirs, remote["device_id"], [(r, n) for r, _, n in runs])
            handle = self.agent.initialize_xfer(
                "READ",
                self.agent.get_xfer_descs(local, self.mem_type),
                self.agent.get_xfer_descs(far, remote["mem_type"]),
                peer,
            )
            if self.agent.transfer(handle) == "ERR":
                raise KVTransferError("the transfer could not start")
            self.pulls[pull_id] = handle
        except Exception as e:  # (NIXL's errors, a peer gone: the pull fails, the engine goes on)
            self.failed[pull_id] = f"{type(e).__name__}: {e}"

    def poll(self) -> tuple[list[str], dict[str, str]]:
        done = []
        for pull_id, handle in list(self.pulls.items()):
            try:
                state = self.agent.check_xfer_state(handle)
            except Exception as e:
                state, why = "ERR", f"{type(e).__name__}: {e}"
            else:
                why = "the transfer failed"
            if state == "PROC":
                continue
            del self.pulls[pull_id]
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:
                pass
            if state == "DONE":
                done.append(pull_id)
            else:
                self.failed[pull_id] = why
        failed, self.failed = self.failed, {}
        return done, failed

    def release(self, remote: dict, request_id: str) -> None:
        try:
            self.agent.send_notif(self._peer(remote), _RELEASE + request_id.encode())
        except Exception:  # the peer is gone: its lease on the blocks ends by itself
            pass

    def released(self) -> list[str]:
        ids = []
        for messages in self.agent.get_new_notifs().values():
            ids += [m[len(_RELEASE) :].decode() for m in messages if m.startswith(_RELEASE)]
        return ids

    def close(self) -> None:
        if self.pulls:  # (a pull still writing into the pool must end before the pool goes)
            for handle in self.pulls.values():
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception:
                    pass
            self.pulls.clear()
        if self.kv is not None:
            self.agent.deregister_memory(self._registration)
            self.kv = None


def _runs(remote: list[int], local: list[int]) -> list[tuple[int, int, int]]:
    """(remote start, local start, count) of the runs where both sides' block ids go up by one."""
    runs: list[list[int]] = []
    for r, lo in zip(remote, local, strict=True):
        if runs and r == runs[-1][0] + runs[-1][2] and lo == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([r, lo, 1])
    return [tuple(x) for x in runs]
