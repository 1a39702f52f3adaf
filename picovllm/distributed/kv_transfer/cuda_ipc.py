"""The CUDA IPC path of a KV pull: between two GPU pools of one machine, the peer's pool mapped
into this process (its IPC handle, exported as JSON) and the blocks gathered from it and
scattered into ours by two kernels on a stream of our own; NIXL still carries the notices
(nixl.py). A pull into blocks that a step launched ahead may still be writing starts after the
work queued on the current stream (`ready`)."""

from __future__ import annotations

import base64

import torch


class CudaIpcCopier:
    """This rank's GPU pool (its KV heads from first_head) and the peers' pools mapped here."""

    def __init__(self, kv: torch.Tensor, first_head: int):
        self.kv, self.first_head = kv, first_head
        self.stream = torch.cuda.Stream(kv.device)
        self.mapped: dict[str, torch.Tensor | None] = {}  # peer name -> its pool (None: not mappable)
        self.copies: dict[str, torch.cuda.Event] = {}  # pull id -> the end of its copies
        self.num_pulls = 0

    def describe(self) -> dict:
        """What a peer needs to map this pool: its handle, and this machine's boot."""
        return {"cuda_ipc": _ipc_export(self.kv), "boot_id": _boot_id()}

    def peer_pool(self, remote: dict) -> torch.Tensor | None:
        """The peer's pool mapped here: both pools on GPUs of this machine booted once, and the
        handle opens here; else None (NIXL then)."""
        name = remote["agent"]
        if name not in self.mapped:
            self.mapped[name] = None
            if remote.get("cuda_ipc") and remote.get("boot_id") == _boot_id():
                try:
                    self.mapped[name] = _ipc_open(remote["cuda_ipc"])
                except Exception:  # (another container, no peer access: NIXL carries it)
                    pass
        return self.mapped[name]

    def copy(self, pull_id, remote_kv: torch.Tensor, r: dict, lo: int, hi: int, remote_blocks, local_blocks, ready):
        """Heads [lo, hi) of the blocks gathered from the peer's pool and scattered into ours, on
        our copy stream once `ready` has passed (a pull's later copies are ordered after its
        earlier ones)."""
        device = self.kv.device
        theirs = slice(lo - r["first_head"], hi - r["first_head"])
        mine = slice(lo - self.first_head, hi - self.first_head)
        if ready is not None:
            self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            src = torch.tensor(remote_blocks, device=remote_kv.device)
            dst = torch.tensor(local_blocks, device=device)
            gathered = remote_kv.index_select(2, src)[:, :, :, theirs].to(device, non_blocking=True)
            self.kv[:, :, :, mine].index_copy_(2, dst, gathered)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.copies[pull_id] = done
        self.num_pulls += 1

    def in_flight(self) -> set[str]:
        """The pulls whose copies have not ended."""
        for pull_id, event in list(self.copies.items()):
            if event.query():
                del self.copies[pull_id]
        return set(self.copies)

    def close(self) -> None:
        for event in self.copies.values():
            event.synchronize()
        self.copies.clear()
        self.mapped.clear()


def _boot_id() -> str:
    """This machine's boot (processes that share it may share GPU memory)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _ipc_export(t: torch.Tensor) -> dict:
    """A CUDA tensor's IPC handle as JSON (torch.multiprocessing's, whose pickle a peer must not be
    made to load)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)
    _, size, stride, offset, _, dtype, device, handle, nbytes, nbytes_offset, _, ref, ref_offset, event, sync = args
    b64 = base64.b64encode
    return {
        "size": list(size),
        "stride": list(stride),
        "offset": offset,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "handle": b64(handle).decode(),
        "storage_bytes": nbytes,
        "storage_offset": nbytes_offset,
        "ref_counter": b64(ref).decode(),
        "ref_counter_offset": ref_offset,
        "event": b64(event).decode() if event else None,
        "event_sync": sync,
    }


def _ipc_open(d: dict) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    unb64 = base64.b64decode
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(d["size"]),
        tuple(d["stride"]),
        d["offset"],
        torch.storage.TypedStorage,
        getattr(torch, d["dtype"]),
        d["device"],
        unb64(d["handle"]),
        d["storage_bytes"],
        d["storage_offset"],
        False,
        unb64(d["ref_counter"]),
        d["ref_counter_offset"],
        unb64(d["event"]) if d["event"] else None,
        d["event_sync"],
    )
