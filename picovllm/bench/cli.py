"""`picovllm bench latency|throughput|prefix|preemption|serve|structured|pd`."""

from __future__ import annotations

import argparse
import contextlib
import signal

from picovllm.bench.common import progress
from picovllm.config import resolve_device
from picovllm.entrypoints.args import (
    engine_kwargs,
    max_num_waiting,
    non_negative_int,
    positive_float,
    positive_int,
    queue_parser,
)


def _ints(s: str) -> list[int]:
    """Comma-separated positive integers."""
    return [positive_int(x) for x in s.split(",") if x]


def _rate(s: str) -> float:
    rate = float(s)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"{s} is out of range: requests/s must be > 0")
    return rate


def _sized(group, flag: str, gpu, cpu, help: str = "", parser=None, **kwargs) -> None:
    """An option whose default is gpu on a GPU and cpu on the CPU, where the GPU's sizes run for
    many minutes (parser: group's, when group is an argument group); sizes() sets it."""
    said = f"(default {_shown(gpu)}; on a CPU {_shown(cpu)})"
    action = group.add_argument(flag, default=None, help=f"{help} {said}" if help else said, **kwargs)
    parser = parser or group
    parser.set_defaults(sized={**(parser.get_default("sized") or {}), action.dest: (flag, gpu, cpu)})


def _shown(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def sizes(args: argparse.Namespace, on_cpu: bool | None = None) -> None:
    """Each sized option not given takes its GPU or its CPU default, by where the run is (on_cpu;
    None: where --device puts the engine); on the CPU a line says which were taken."""
    on_cpu = resolve_device(args.device).type == "cpu" if on_cpu is None else on_cpu
    taken = []
    for dest, (flag, gpu, cpu) in (getattr(args, "sized", None) or {}).items():
        if getattr(args, dest) is None:
            setattr(args, dest, cpu if on_cpu else gpu)
            taken.append(f"{flag} {_shown(cpu)}")
    if on_cpu and taken:
        progress(f"on the CPU, sized to take minutes: {' '.join(taken)} (give any of them to change it)")


def add_bench_parser(sub, engine_parser: argparse.ArgumentParser) -> None:
    bench = sub.add_parser("bench", help="benchmarks: latency, throughput, prefix, preemption, serve, structured, pd")
    bench.set_defaults(parser=bench)
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")

    lat = kinds.add_parser(
        "latency",
        parents=[engine_parser],
        help="decode speed at fixed batch sizes",
        description="Decode ms/step, tok/s and achieved memory bandwidth per batch size; greedy, or "
        "with the sampling settings the model's generation config asks for (--generation-config).",
    )
    _sized(lat, "--batch-sizes", [1, 8, 32, 128], [1, 8], type=_ints, help="comma-separated")
    _sized(lat, "--input-len", 128, 32, type=positive_int, help="prompt tokens")
    _sized(lat, "--output-len", 512, 64, type=positive_int, help="generated tokens")
    lat.add_argument(
        "--hf",
        action="append",
        default=[],
        choices=["eager", "compiled"],
        help="also run Hugging Face transformers in this mode (repeatable)",
    )
    lat.add_argument("--repeat", type=positive_int, default=1, help="time each run this many times and keep the best")
    lat.add_argument("--plot", default=None, metavar="PNG", help="save a plot of tok/s and bandwidth here")
    lat.add_argument("--seed", type=non_negative_int, default=0)
    lat.set_defaults(func=_latency, parser=lat)

    thr = kinds.add_parser(
        "throughput",
        parents=[engine_parser],
        help="offline throughput",
        description="256 requests, lengths uniform in [100, 1024], ignore_eos, T=0.6.",
    )
    _sized(thr, "--num-prompts", 256, 16, type=positive_int)
    _sized(thr, "--min-len", 100, 16, type=positive_int)
    _sized(thr, "--max-len", 1024, 64, type=positive_int)
    thr.add_argument("--seed", type=non_negative_int, default=0)
    thr.set_defaults(func=_throughput, parser=thr)

    pre = kinds.add_parser(
        "prefix",
        parents=[engine_parser],
        help="prefix caching: TTFT, hit rate, cost",
        description="Shared system prompts, a long shared prefix, and no sharing; cache on against off. "
        "Then multi-turn chats whose histories outgrow the GPU pool: the host tier off against on.",
    )
    _sized(pre, "--repeat", 3, 1, type=positive_int, help="wall-time runs per engine, best kept")
    _sized(pre, "--scale", 1.0, 0.25, type=positive_float, help="(a)-(c)'s lengths times this")
    pre.add_argument("--seed", type=non_negative_int, default=0)
    mt = pre.add_argument_group("(d) multi-turn chats, the KV cache's host tier off and on")
    _sized(mt, "--conversations", 64, 8, type=positive_int, parser=pre)
    _sized(mt, "--turns", 8, 3, type=positive_int, parser=pre)
    _sized(mt, "--first-len", 1024, 128, type=positive_int, help="the first prompt's tokens", parser=pre)
    _sized(mt, "--turn-len", 96, 16, type=positive_int, help="new tokens a later turn adds", parser=pre)
    _sized(mt, "--answer-len", 32, 8, type=positive_int, help="an answer's tokens", parser=pre)
    _sized(mt, "--concurrency", 16, 4, type=positive_int, help="sequences that run at a time", parser=pre)
    mt.add_argument("--pressure", type=float, default=3.5, help="the final histories' KV / the GPU pool")
    pre.set_defaults(func=_prefix, parser=pre)

    pmt = kinds.add_parser(
        "preemption",
        parents=[engine_parser],
        help="preemption by recompute against swap",
        description="Requests at once in a GPU pool that holds a fraction of their KV: preemption_mode "
        "recompute, then swap (to a host tier the benchmark sizes): throughput, latency percentiles.",
    )
    _sized(pmt, "--requests", 64, 8, type=positive_int)
    # (on the CPU, short prompts and long outputs: admission keeps room for the prompts, so only
    # the outputs' growth preempts)
    _sized(pmt, "--input-len", 1024, 16, type=positive_int)
    _sized(pmt, "--output-len", 256, 64, type=positive_int)
    pmt.add_argument("--pressure", type=float, default=3.5, help="the requests' KV / the GPU pool")
    pmt.add_argument("--seed", type=non_negative_int, default=0)
    pmt.set_defaults(func=_preemption, parser=pmt)

    srv = kinds.add_parser(
        "serve",
        parents=[engine_parser, queue_parser()],
        help="the HTTP server under streaming load",
        description="Streaming clients against /v1/completions: throughput, TTFT, TPOT, ITL. "
        "Without --base-url, starts a server in-process with the engine options.",
    )
    srv.add_argument("--base-url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--api-key", default=None)
    _sized(
        srv,
        "--num-prompts",
        1000,
        32,
        type=positive_int,
        help="requests in all (vLLM's default; with fewer, the start and the drain weigh on the percentiles)",
    )
    _sized(srv, "--concurrency", 64, 8, type=positive_int)
    srv.add_argument("--request-rate", type=_rate, default=float("inf"), help="requests/s (Poisson); default: all")
    _sized(srv, "--input-len", 512, 64, type=positive_int)
    _sized(srv, "--output-len", 128, 32, type=positive_int)
    srv.add_argument(
        "--disable-frontend-multiprocessing",
        action="store_true",
        help="in-process server: the engine on a thread of the server's process (as `picovllm serve`)",
    )
    srv.add_argument(
        "--api-server-count",
        type=positive_int,
        default=1,
        help="HTTP processes around the engine process, as `picovllm serve --api-server-count` (default 1)",
    )
    srv.add_argument("--save-dir", default=None, help="write serve_results.json and serve_latency.png here")
    srv.add_argument("--seed", type=non_negative_int, default=0)
    srv.add_argument(
        "--client-processes",
        type=positive_int,
        default=None,
        help="processes the clients are spread over; default: half the CPUs, at most 8",
    )
    srv.set_defaults(func=_serve, parser=srv)

    st = kinds.add_parser(
        "structured",
        parents=[engine_parser],
        help="structured outputs' cost: decode under a JSON schema against unconstrained",
        description="A batch decodes the same number of tokens unconstrained, then under a JSON schema, at "
        "temperature 0.6 or with the sampling settings the model's generation config asks for "
        "(--generation-config); and the grammar compile times. A dummy model needs --tokenizer DIR.",
    )
    _sized(st, "--batch-size", 64, 8, type=positive_int)
    _sized(st, "--input-len", 128, 32, type=positive_int)
    _sized(st, "--output-len", 256, 32, type=positive_int)
    st.add_argument("--seed", type=non_negative_int, default=0)
    _sized(st, "--repeat", 3, 1, type=positive_int, help="runs of each kind, taking turns, best kept")
    st.set_defaults(func=_structured, parser=st)

    pd = kinds.add_parser(
        "pd",
        parents=[engine_parser],
        help="disaggregated serving against colocated",
        description="The colocated server, then a prefill and a decode instance behind the router, under the "
        "same streaming workload; the KV transfer of one long prompt; TTFT split into prefill, transfer, rest.",
    )
    pd.add_argument("--num-prompts", type=positive_int, default=256)
    pd.add_argument("--concurrency", type=positive_int, default=64)
    pd.add_argument("--input-len", type=positive_int, default=1024)
    pd.add_argument("--output-len", type=positive_int, default=128)
    pd.add_argument("--transfer-len", type=positive_int, default=2083, help="the prompt whose transfer is timed")
    pd.add_argument("--seed", type=non_negative_int, default=0)
    pd.set_defaults(func=_pd, parser=pd)


def _latency(args: argparse.Namespace) -> int:
    sizes(args)
    from picovllm.bench.latency import run_latency

    kwargs = engine_kwargs(args)
    kwargs.pop("max_num_seqs")
    run_latency(kwargs, args.batch_sizes, args.input_len, args.output_len, args.hf, args.seed, args.repeat, args.plot)
    return 0


def _structured(args: argparse.Namespace) -> int:
    sizes(args)
    from picovllm.bench.structured import run_structured

    run_structured(engine_kwargs(args), args.batch_size, args.input_len, args.output_len, args.seed, args.repeat)
    return 0


def _throughput(args: argparse.Namespace) -> int:
    sizes(args)
    from picovllm.bench.throughput import run_throughput

    run_throughput(engine_kwargs(args), args.num_prompts, args.min_len, args.max_len, args.seed)
    return 0


def _own_pools(args: argparse.Namespace) -> dict:
    """The engine options, less those the benchmark sets itself (pool sizes, preemption)."""
    kwargs = engine_kwargs(args)
    for name in ("kv_cache_memory", "kv_offload_memory", "preemption_mode", "max_num_seqs", "max_model_len"):
        kwargs.pop(name)
    return kwargs


def _preemption(args: argparse.Namespace) -> int:
    sizes(args)
    from picovllm.bench.offload import run_preemption

    run_preemption(_own_pools(args), args.requests, args.input_len, args.output_len, args.pressure, args.seed)
    return 0


def _prefix(args: argparse.Namespace) -> int:
    sizes(args)
    from picovllm.bench.offload import run_multi_turn
    from picovllm.bench.prefix import run_prefix

    run_prefix(engine_kwargs(args), args.seed, args.repeat, args.scale)
    run_multi_turn(
        _own_pools(args),
        args.conversations,
        args.turns,
        args.first_len,
        args.turn_len,
        args.answer_len,
        args.pressure,
        args.concurrency,
        args.seed,
    )
    return 0


def _pd(args: argparse.Namespace) -> int:
    sizes(args)
    from picovllm.bench.pd import run_pd_bench

    run_pd_bench(
        engine_kwargs(args),
        args.num_prompts,
        args.concurrency,
        args.input_len,
        args.output_len,
        args.transfer_len,
        args.seed,
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    sizes(args, on_cpu=False if args.base_url else None)  # (a running server's sizes: a GPU's)
    from picovllm.bench.serve import EngineProbe, run_serve_bench
    from picovllm.entrypoints.cli import listen, multiprocess_metrics, start_http_processes, stop_processes
    from picovllm.entrypoints.openai.async_engine import frozen_heap, start_background_engine

    name, url, stop, vocab, others = args.served_model_name, args.base_url, None, 30000, []
    count = args.api_server_count if url is None else 1
    with multiprocess_metrics(count):
        if url is None:
            from picovllm.entrypoints.openai.server import build_app, serve_in_thread

            engine = start_background_engine(engine_kwargs(args), args.disable_frontend_multiprocessing, count)
            name = name or args.model or "default"
            vocab = min(vocab, engine.vocab_size)
            app_args = {"served_model_name": name, "api_key": args.api_key, "max_num_waiting": max_num_waiting(args)}
            sock = listen("127.0.0.1", 0, reuse_port=count > 1)
            url, stop = serve_in_thread(build_app(engine, **app_args), sock=sock)
            if count > 1:
                others = start_http_processes(engine, sock.getsockname()[:2], app_args, ("warning", False))
        try:
            with frozen_heap() if stop is not None else contextlib.nullcontext():  # (as picovllm serve)
                run_serve_bench(
                    url,
                    name,
                    args.num_prompts,
                    args.concurrency,
                    args.request_rate,
                    args.input_len,
                    args.output_len,
                    vocab,
                    args.api_key,
                    args.seed,
                    args.save_dir,
                    client_processes=args.client_processes,
                    probe=EngineProbe(engine, others) if stop is not None else None,
                )
        finally:
            stop_processes(others, signal.SIGTERM, 30)  # (SIGTERM: they drain, and nothing is in flight)
            if stop is not None:
                stop()
                engine.shutdown()
    return 0
