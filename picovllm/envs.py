"""The environment variables Pico-vLLM reads: debugging switches, each documented here. Every
other setting is an engine option (EngineConfig, CLI flags). The model cache's location
(PICOVLLM_CACHE, then XDG_CACHE_HOME) is read where the cache is (model_source/builtin.py).

    PICOVLLM_CHECK_INVARIANTS=1  after every step, check every block's reference count, the
                                 prefix tree's locks and block conservation (slow; read when
                                 an engine is built)
    PICOVLLM_DISABLE_TRITON=1    run the PyTorch reference of every kernel, also on a GPU (no
                                 CUDA graphs then; read when picovllm.kernels is imported)
    PICOVLLM_LOGGING_LEVEL=info  the picovllm logger's level in a process the command line
                                 started (set by it: logger.py), and LLM()'s (default info)
    PICOVLLM_CONFIGURE_LOGGING=0 LLM() leaves logging alone (as vLLM's VLLM_CONFIGURE_LOGGING)

And what torchrun sets, to start the tensor-parallel ranks as its processes: RANK, WORLD_SIZE
and LOCAL_RANK (torch.distributed reads MASTER_ADDR and MASTER_PORT itself).
"""

from __future__ import annotations

import os


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def check_invariants() -> bool:
    return _flag("PICOVLLM_CHECK_INVARIANTS")


def disable_triton() -> bool:
    return _flag("PICOVLLM_DISABLE_TRITON")


def configure_logging() -> bool:
    return os.environ.get("PICOVLLM_CONFIGURE_LOGGING", "1") != "0"


def logging_level() -> str | None:
    return os.environ.get("PICOVLLM_LOGGING_LEVEL") or None


def set_logging_level(level: str) -> None:
    os.environ["PICOVLLM_LOGGING_LEVEL"] = level  # (the processes this one starts inherit it)


def torchrun_ranks() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when torchrun started this process, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))
