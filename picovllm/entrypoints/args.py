"""The options every command shares: engine options (EngineConfig's fields) and sampling options
(SamplingParams' fields), as argparse parents, each number checked when it is parsed."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from picovllm.sampling_params import SamplingParams


def _number(
    kind: type, low: float | None = None, high: float | None = None, low_open: bool = False, what: str = ""
) -> Callable[[str], int | float]:
    """An argparse type: a number of this kind within [low, high] ((low, high] with low_open)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        below = low is not None and (value <= low if low_open else value < low)
        if below or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text} is out of range: {what}")
        return value

    return parse


positive_int = _number(int, 1, what="must be >= 1")
non_negative_int = _number(int, 0, what="must be >= 0")
port = _number(int, 1, 65535, what="a port is 1-65535")
fraction = _number(float, 0.0, 1.0, low_open=True, what="must be in (0, 1]")
non_negative_float = _number(float, 0.0, what="must be >= 0")
positive_float = _number(float, 0.0, low_open=True, what="must be > 0")

# (flag, SamplingParams field, type, help)
SAMPLING_FLAGS = [
    ("--max-tokens", "max_tokens", positive_int, "maximum number of tokens to generate per completion"),
    ("--min-tokens", "min_tokens", non_negative_int, "generate at least this many tokens before EOS or stop"),
    ("--temperature", "temperature", non_negative_float, "sampling temperature; 0 is greedy"),
    ("--top-p", "top_p", fraction, "nucleus sampling: keep the most likely tokens up to this probability mass"),
    ("--top-k", "top_k", int, "keep only the k most likely tokens (0 or -1: off)"),
    (
        "--min-p",
        "min_p",
        _number(float, 0.0, 1.0, what="must be in [0, 1]"),
        "drop tokens below min_p times the most likely token's probability",
    ),
    (
        "--repetition-penalty",
        "repetition_penalty",
        _number(float, 0.0, low_open=True, what="must be > 0"),
        "penalise tokens already in the prompt or output (1: off)",
    ),
    ("--presence-penalty", "presence_penalty", float, "penalise tokens already in the output (0: off)"),
    ("--frequency-penalty", "frequency_penalty", float, "penalise tokens by their count in the output (0: off)"),
    ("--seed", "seed", non_negative_int, "random seed of the sampler (and of the engine)"),
    ("--n", "n", positive_int, "completions per prompt"),
    ("--logprobs", "logprobs", non_negative_int, "return this many top log-probabilities per token"),
]


def engine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("engine options")
    g.add_argument(
        "--model",
        "-m",
        default=None,
        help="a local Hugging Face directory, a .gguf file, a built-in model name (see `picovllm "
        "models`) or dummy:SHAPE for random weights; default: qwen2.5-coder-0.5b-instruct",
    )
    g.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32 (default: the checkpoint's)")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda (default: cuda when available)")
    g.add_argument("--max-model-len", type=positive_int, default=None, help="longest prompt + output, in tokens")
    g.add_argument("--max-num-seqs", type=positive_int, default=256, help="most requests in a batch")
    g.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=None,
        help="token budget of a step, decodes and prefill chunks together (default 8192)",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefill long prompts over several steps, mixed with decodes",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="launch each step before the previous one's tokens are read (default: on)",
    )
    g.add_argument(
        "--mixed-graph-tokens",
        type=_number(int, 0, 8192, what="must be in [0, 8192]"),
        default=512,
        help="replay steps with prompt tokens of up to this many tokens from CUDA graphs too (0: eager)",
    )
    g.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV-cache block")
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=positive_int,
        default=1,
        help="split the model over this many GPUs (or CPU processes), one process each",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=fraction,
        default=0.9,
        help="this instance's fraction of GPU memory, for weights, activations and KV cache "
        "(instances sharing a GPU: fractions that add up to at most 1)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=positive_int,
        default=None,
        help="bytes of KV cache; overrides --gpu-memory-utilization (default on CPU: 2 GiB)",
    )
    g.add_argument(
        "--kv-offload-memory",
        type=_number(int, 0, what="must be >= 0"),
        default=0,
        help="bytes of host memory for a second tier of the KV cache: the prefix cache demotes what "
        "it evicts from the GPU there and promotes it back on a hit (0: off)",
    )
    g.add_argument(
        "--preemption-mode",
        choices=["recompute", "swap"],
        default="recompute",
        help="a preempted request's KV: recomputed when it resumes, or swapped to the host tier and "
        "back (needs --kv-offload-memory)",
    )
    g.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run every step eagerly instead of replaying CUDA graphs captured at start-up (GPU only)",
    )
    g.add_argument(
        "--no-prefix-caching", dest="enable_prefix_caching", action="store_false", help="turn prefix caching off"
    )
    return p


def sampling_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("sampling options")
    for flag, _, typ, help_ in SAMPLING_FLAGS:
        g.add_argument(flag, type=typ, default=None, help=help_)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")
    return p


def queue_parser() -> argparse.ArgumentParser:
    """The server's bound on requests waiting for the engine (serve and bench serve)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--max-num-waiting",
        type=positive_int,
        default=None,
        help="requests that may wait for the engine; beyond them a request gets 503 and Retry-After "
        "(default 8 x --max-num-seqs)",
    )
    return p


def max_num_waiting(args: argparse.Namespace) -> int:
    return args.max_num_waiting if args.max_num_waiting is not None else 8 * args.max_num_seqs


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,
        kv_offload_memory=args.kv_offload_memory,
        preemption_mode=args.preemption_mode,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        mixed_graph_tokens=args.mixed_graph_tokens,
        async_scheduling=args.async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    if getattr(args, "seed", None) is not None:
        kwargs["seed"] = args.seed
    for name in ("kv_role", "kv_transfer_mode", "kv_lease_s", "kv_pull_timeout_s", "kv_transfer_backend"):  # (serve's)
        if hasattr(args, name):
            kwargs[name] = getattr(args, name)
    return kwargs


def sampling_values(args: argparse.Namespace) -> dict:
    """The sampling options given on the command line, by SamplingParams field."""
    values = {name: getattr(args, name) for _, name, _, _ in SAMPLING_FLAGS if getattr(args, name) is not None}
    if args.stop:
        values["stop"] = args.stop
    if args.ignore_eos:
        values["ignore_eos"] = True
    return values


def sampling_params(args: argparse.Namespace, **defaults) -> SamplingParams:
    return SamplingParams(**{**defaults, **sampling_values(args)})
