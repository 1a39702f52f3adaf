"""KV transfer between instances (disaggregated prefill): a decode instance pulls the KV blocks of a
prompt that a prefill instance computed, straight from that instance's pool into its own.

KVTransfer is what the engine's side (engine/kv_handoff.py) calls, through the rank that holds
the pool: register the pool, describe it to peers (agent_info, JSON), pull remote blocks into
local ones, poll the pulls, and send a peer's rank 0 LeaseNotices about the blocks it holds for
this side (renew the lease, release it; the peer reads them with `notices`). Its backend is
NIXL (nixl.py), with a CUDA IPC path between two GPU pools of one machine (cuda_ipc.py).

The pool is the model runner's [layers, 2, num_blocks, kv_heads, block_size, head_dim] tensor
(worker/model_runner.py, allocate_kv_pool): a block of one layer's K (or V) is contiguous, and so
is a run of its heads.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch


class KVTransferError(RuntimeError):
    pass


@dataclass(frozen=True)
class LeaseNotice:
    """What a decode instance tells the prefill instance holding a prompt's KV for it: "renew"
    (the request still waits here: keep the blocks another lease), "release" (they will not be
    read), "pulled" (they have been read). Both of the last two end the lease."""

    kind: Literal["renew", "release", "pulled"]
    request_id: str

    _TAG = b"picovllm-lease:"

    def encode(self) -> bytes:
        return self._TAG + json.dumps([self.kind, self.request_id]).encode()

    @classmethod
    def decode(cls, message: bytes) -> LeaseNotice | None:
        """The notice a message carries (None: not one of ours, or malformed)."""
        if not message.startswith(cls._TAG):
            return None
        try:
            kind, request_id = json.loads(message[len(cls._TAG) :])
        except (ValueError, TypeError):
            return None
        if kind not in ("renew", "release", "pulled") or not isinstance(request_id, str):
            return None
        return cls(kind, request_id)


class KVTransfer(ABC):
    @abstractmethod
    def register(self, kv_cache: torch.Tensor) -> None:
        """The KV pool peers will read from and this side pulls into."""

    @abstractmethod
    def agent_info(self) -> dict:
        """What a peer needs to pull from this pool (JSON: it travels in kv_transfer_params)."""

    @abstractmethod
    def pull(
        self, pull_id: str, remote: dict, remote_blocks: list[int], local_blocks: list[int], after: bool = False
    ) -> None:
        """Start copying the remote pool's blocks into ours (remote_blocks[i] -> local_blocks[i]);
        after: only once the work already queued on our device has ended (a step in flight may
        still write the local blocks)."""

    @abstractmethod
    def poll(self) -> tuple[list[str], dict[str, str]]:
        """The pulls that completed since the last call, and those that failed (id -> why)."""

    @abstractmethod
    def notify(self, remote: dict, notice: LeaseNotice) -> None:
        """Send the remote instance (its rank 0, which holds the leases) a notice; a peer gone is
        not an error (its leases end by themselves)."""

    @abstractmethod
    def notices(self) -> list[LeaseNotice]:
        """The notices peers sent since the last call."""

    def stats(self) -> dict[str, int]:
        """The backend's own counters (LLMEngine.get_metrics)."""
        return {}

    @abstractmethod
    def close(self) -> None:
        """End the pulls in flight and unregister the pool."""


def block_runs(remote: list[int], local: list[int]) -> list[tuple[int, int, int]]:
    """(remote start, local start, count) of the runs where both sides' block ids go up by one."""
    runs: list[list[int]] = []
    for r, lo in zip(remote, local, strict=True):
        if runs and r == runs[-1][0] + runs[-1][2] and lo == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([r, lo, 1])
    return [tuple(x) for x in runs]
