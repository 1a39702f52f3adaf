"""KV transfer between instances: the interface (base.py), its NIXL backend (nixl.py) and the
CUDA IPC path beside it (cuda_ipc.py)."""

from picovllm.distributed.kv_transfer.base import KVTransfer, KVTransferError, LeaseNotice, block_runs

__all__ = ["KVTransfer", "KVTransferError", "LeaseNotice", "block_runs"]
