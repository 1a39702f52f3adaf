"""The `picovllm` command: generate, chat, serve, models, bench."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time

from picovllm import envs
from picovllm.entrypoints.args import (
    engine_kwargs,
    engine_parser,
    max_num_waiting,
    port,
    positive_float,
    positive_int,
    queue_parser,
    sampling_params,
    sampling_parser,
    sampling_values,
)
from picovllm.entrypoints.openai.tool_calls import TOOL_PARSERS
from picovllm.logger import configure_logging

GRACEFUL_SHUTDOWN_S = 5  # what open streams get to finish after Ctrl-C before they are cut
DRAIN_S = 300  # what in-flight requests get to finish after SIGTERM (no new connection is taken)


def listen(host: str, port: int, reuse_port: bool = False):
    """A socket bound to host:port, for the server to take (_serve_http): a port in use is an
    error before the model loads, not after. ValueError when it cannot be bound. reuse_port: the
    port shared by the sockets of serve's HTTP processes (--api-server-count), each binding its
    own: the kernel spreads the connections over them (one socket shared would leave them to
    whichever process accepts first, in practice one)."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn binds)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class _Stop(BaseException):
    """SIGTERM, raised again by uvicorn once it has drained (_serve_http)."""


class _AccessLogFilter(logging.Filter):
    """uvicorn's access lines less those of some paths (vLLM's --disable-access-log-for-endpoints)."""

    def __init__(self, paths: set[str]):
        super().__init__()
        self.paths = paths

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()  # (client, method, path, version, status)
        return len(args) < 3 or str(args[2]).split("?", 1)[0] not in self.paths


def _serve_http(
    app,
    sock,
    log_level: str,
    access_log: bool = True,
    quiet_paths: str = "",
    engine=None,
    others: list = (),
    quiet: bool = False,
) -> bool:
    """uvicorn on sock (listen), stopping on Ctrl-C (open streams get GRACEFUL_SHUTDOWN_S) or
    draining on SIGTERM: it stops taking connections, and the requests in flight finish (within
    DRAIN_S); a prefill instance then also waits for its held KV to be pulled or its leases to
    end (server.py). With an engine, it also stops when the engine has died (its streams ended
    with the error), or when one of the `others` (serve's other HTTP processes) has: returns
    False then, True when told to stop. The others get this process's SIGTERM as it comes, and
    its Ctrl-C once it has stopped (a terminal's reaches them at once), and are waited for.
    uvicorn raises the signal that stopped it again once it has stopped: here that is the end,
    said in one line (quiet: nothing said, serve's own process says it). access_log: uvicorn's
    line for each request, less those for quiet_paths (comma-separated)."""
    import signal

    import uvicorn

    say = (lambda _: None) if quiet else _say

    class Server(uvicorn.Server):
        died = False  # (the engine, or another HTTP process)
        draining = False

        def handle_exit(self, sig, frame) -> None:
            if sig == signal.SIGTERM:
                self.config.timeout_graceful_shutdown = DRAIN_S
                self.draining = True
                for p in others:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGTERM)
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if not self.died:
                if engine is not None and engine.error is not None:
                    say(f"the engine has stopped ({engine.error!r}): the server stops")
                    self.died = True
                elif dead := [p for p in others if p.exitcode is not None]:
                    say(f"HTTP process {dead[0].name} exited (code {dead[0].exitcode}): the server stops")
                    self.died = True
            return self.died or await super().on_tick(counter)

    def stop(sig, frame):
        raise _Stop

    config = uvicorn.Config(
        app, log_level=log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, access_log=access_log
    )
    access = _AccessLogFilter({p.strip() for p in quiet_paths.split(",") if p.strip()})
    logging.getLogger("uvicorn.access").addFilter(access)  # (after the Config, which sets uvicorn's loggers up)
    server = Server(config)
    before = signal.signal(signal.SIGTERM, stop)
    stopped = False
    try:
        server.run(sockets=[sock])
    except (KeyboardInterrupt, _Stop):
        stopped = True
    finally:
        signal.signal(signal.SIGTERM, before)
        logging.getLogger("uvicorn.access").removeFilter(access)
        sock.close()
        if server.draining:  # (they have had the SIGTERM)
            stop_processes(others, None, DRAIN_S + 10)
        else:
            stop_processes(others, signal.SIGINT, GRACEFUL_SHUTDOWN_S + 10)
    if stopped:
        say("stopped")
    return not server.died


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.file:
        try:
            with sys.stdin if args.file == "-" else open(args.file) as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise ValueError(f"cannot read --file {args.file}: {e.strerror or e}") from None
    if not prompts:
        raise ValueError("give prompts as arguments or with --file")
    return prompts


def _prompt_ids(kwargs: dict, prompts: list[str], params, chat: bool) -> list[dict]:
    """The prompts as checked token ids, before the weights load (about a second against the
    many a model takes): each (with chat, as a user message in the chat template) tokenized and
    checked against the model's context and the sampling parameters; the engine checks the ids
    again against what its KV cache holds."""
    from picovllm.config import EngineConfig, resolve_max_model_len
    from picovllm.engine.input_processor import load_tokenizer, process_prompt, tokenizer_source
    from picovllm.model_source import resolve_model

    config = EngineConfig(**kwargs)
    config.validate()
    model_config, path = resolve_model(config.model)
    source = tokenizer_source(config, path)
    tokenizer = load_tokenizer(source) if source else None
    max_model_len = resolve_max_model_len(config, model_config)
    checked = []
    for prompt in prompts:
        if chat and tokenizer is not None:
            if not tokenizer.chat_template:
                raise ValueError("this model has no chat template")
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            prompt = tokenizer.encode(text, add_special_tokens=False)
        _, ids = process_prompt(prompt, params, tokenizer, model_config.vocab_size, max_model_len)
        checked.append({"prompt_token_ids": ids})
    return checked


def _start(kwargs: dict, quiet: bool = False):
    """The engine, with a line before (loading takes seconds) and one after."""
    from picovllm import LLM

    if not quiet:
        _say(f"loading {kwargs['model'] or 'the default model'}...")
    start = time.perf_counter()
    llm = LLM(**kwargs)
    engine = llm.llm_engine
    graphs = f", CUDA graphs captured in {engine.graph_capture_s:.1f} s" if engine.graph_capture_s else ""
    dtype = str(engine.dtype).removeprefix("torch.")
    if not quiet:
        _say(
            f"ready in {time.perf_counter() - start:.1f} s on {engine.device} ({dtype}, "
            f"{engine.block_manager.num_total_blocks} KV blocks, max_model_len {engine.max_model_len}{graphs})"
        )
    return llm


def _summary(outputs, seconds: float) -> str:
    """One line for a run: requests, tokens, throughput and time to first token."""
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    ttfts = [
        o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outputs if "first_token_time" in o.metrics
    ]
    ttft = f", time to first token {1e3 * sum(ttfts) / len(ttfts):.0f} ms" if ttfts else ""
    mean = " (mean)" if len(ttfts) > 1 else ""
    return (
        f"{len(outputs)} prompt{'s' if len(outputs) > 1 else ''} ({prompt} tokens), {generated} tokens "
        f"generated in {seconds:.2f} s: {generated / seconds:.1f} tok/s{ttft}{mean}"
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    prompts = _read_prompts(args)
    params = sampling_params(args, max_tokens=256, temperature=0.7)
    kwargs = engine_kwargs(args)
    prompt_ids = _prompt_ids(kwargs, prompts, params, args.chat_template)
    llm = _start(kwargs, args.quiet)
    params = sampling_params(args, llm.llm_engine.sampling_defaults, max_tokens=256, temperature=0.7)
    start = time.perf_counter()
    if len(prompts) == 1 and params.n == 1:  # (one completion: its text as it comes)
        outputs = [_stream(llm.llm_engine, prompts[0], prompt_ids[0], params, args)]
    else:
        outputs = llm.generate(prompt_ids, params, use_tqdm=not args.quiet)
        for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
            for completion in out.outputs:
                _print_head(prompt, completion.index, args, first=i == 0 and completion.index == 0)
                print(completion.text, end="")
                _print_tail(completion, args)
    if not args.quiet:
        _say(_summary(outputs, seconds=time.perf_counter() - start))
    return 0


def _stream(engine, prompt: str, ids, params, args: argparse.Namespace):
    """One request's completion printed as it is generated (params: CUMULATIVE, the default);
    its last RequestOutput."""
    rid = engine.add_request(None, ids, params)
    _print_head(prompt, 0, args, first=True)
    shown, last = 0, None
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = out.outputs[0].text
                print(text[shown:], end="", flush=True)
                shown, last = len(text), out
            for _, why in engine.take_failed():
                raise ValueError(why)
    except KeyboardInterrupt:
        engine.abort_request(rid)
        print()
        raise
    _print_tail(last.outputs[0], args)
    return last


def _print_head(prompt: str, index: int, args: argparse.Namespace, first: bool) -> None:
    """What comes before a completion's text: with --quiet a blank line between two, else a
    line naming its prompt, then the prompt (the text goes on from it; not with a template)."""
    if args.quiet:
        print("" if first else "\n", end="")
    else:
        print(f"--- {prompt!r} [{index}]\n{prompt if not args.chat_template else ''}", end="")


def _print_tail(completion, args: argparse.Namespace) -> None:
    """What comes after a completion's text: its length and why it ended, and with --logprobs
    each token's logprob and the top alternatives."""
    print()
    if args.quiet:
        return
    print(f"({len(completion.token_ids)} tokens, {completion.finish_reason})")
    for token, entries in zip(completion.token_ids, completion.logprobs or []):
        chosen = entries[token]
        others = sorted((e for t, e in entries.items() if t != token), key=lambda e: e.rank)
        top = ", ".join(f"{e.decoded_token!r} {e.logprob:.3f}" for e in others)
        print(f"  {chosen.decoded_token!r} {chosen.logprob:.3f}" + (f"  (others: {top})" if top else ""))


def _cmd_chat(args: argparse.Namespace) -> int:
    from picovllm.entrypoints.openai.tool_calls import HermesToolParser
    from picovllm.sampling_params import RequestOutputKind

    params = sampling_params(args, max_tokens=1024, temperature=0.7, output_kind=RequestOutputKind.DELTA)
    if params.n != 1:
        raise ValueError("chat keeps one conversation: --n must be 1 (generate shows n completions)")
    tools = _read_tools(args.tools) if args.tools else None
    engine = _start(engine_kwargs(args)).llm_engine
    if engine.tokenizer is None or not engine.tokenizer.chat_template:
        raise ValueError("this model has no chat template")
    params = sampling_params(
        args, engine.sampling_defaults, max_tokens=1024, temperature=0.7, output_kind=RequestOutputKind.DELTA
    )
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    _say("Chat with the model. /reset clears the conversation, /exit or Ctrl-D quits.")
    while True:
        try:
            user = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if user == "/exit":
            return 0
        if user == "/reset":
            history = history[:1] if args.system else []
            _say("(conversation cleared)")
            continue
        if not user:
            continue
        calls = history[-1].get("tool_calls") if history else None
        if user.startswith("/tool ") and calls:  # (the result of the model's last tool call)
            history.append({"role": "tool", "tool_call_id": calls[-1]["id"], "content": user[6:]})
        else:
            history.append({"role": "user", "content": user})
        reply = _chat_turn(engine, history, params, tools)
        if reply is None:
            history.pop()
            continue
        content, calls = HermesToolParser({t["function"]["name"] for t in tools}).parse(reply) if tools else (reply, [])
        for call in calls:
            _say(f"tool call: {call.name}({call.arguments}); answer it with /tool RESULT")
        history.append(
            {"role": "assistant", "content": content, **({"tool_calls": [c.to_dict() for c in calls]} if calls else {})}
        )


def _read_tools(path: str) -> list[dict]:
    """--tools: a JSON file of tools in OpenAI's format (a list of {"type": "function", ...})."""
    with open(path) as f:
        tools = json.load(f)
    if not isinstance(tools, list) or not all(isinstance(t, dict) and "name" in t.get("function", {}) for t in tools):
        raise ValueError(f'{path}: tools must be a JSON list of {{"type": "function", "function": {{"name": ...}}}}')
    return tools


def _chat_turn(engine, history: list[dict], params, tools: list[dict] | None) -> str | None:
    """The model's reply to the conversation, streamed to the terminal (None: it was refused)."""
    from picovllm.entrypoints.openai.tool_calls import template_messages

    text = engine.tokenizer.apply_chat_template(
        template_messages(history), tools=tools, tokenize=False, add_generation_prompt=True
    )
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    try:
        rid = engine.add_request(None, ids, params)
    except ValueError as e:
        _say(f"error: {e}")
        return None
    start, reply, tokens, first = time.perf_counter(), "", 0, None
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                piece = out.outputs[0]
                if piece.token_ids and first is None:
                    first = time.perf_counter()
                tokens += len(piece.token_ids)
                reply += piece.text
                print(piece.text, end="", flush=True)
    except KeyboardInterrupt:
        engine.abort_request(rid)
    print()
    end = time.perf_counter()
    if first is not None:
        rate = f", {(tokens - 1) / (end - first):.1f} tok/s" if tokens > 1 and end > first else ""
        _say(f"({tokens} tokens, time to first token {1e3 * (first - start):.0f} ms{rate})")
    return reply


def _cmd_serve(args: argparse.Namespace) -> int:
    from picovllm.entrypoints.openai.async_engine import check_api_server_count

    args.model = args.model_tag or args.model
    count = args.api_server_count
    check_api_server_count(count, args.disable_frontend_multiprocessing)  # (before the model loads)
    with multiprocess_metrics(count):
        return _serve(args, count)


@contextlib.contextmanager
def multiprocess_metrics(count: int):
    """With count > 1 HTTP processes, their Prometheus metrics in a directory of their own
    (prometheus_client's multiprocess mode, metrics.py), removed on the way out. Entered before
    prometheus_client is first imported, here and in the HTTP processes, which inherit it."""
    if count == 1:
        yield
        return
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="picovllm-metrics-")
    try:
        yield
    finally:
        shutil.rmtree(os.environ.pop("PROMETHEUS_MULTIPROC_DIR"), ignore_errors=True)


def stop_processes(procs: list, sig: int | None, wait_s: float) -> None:
    """Each of procs sent sig if it is alive (None: it has had its signal), waited for up to
    wait_s, then killed."""
    for p in procs:
        if sig is not None and p.is_alive():
            os.kill(p.pid, sig)
        p.join(timeout=wait_s)
        if p.is_alive():
            p.kill()


def _serve(args: argparse.Namespace, count: int) -> int:
    """serve's server: this process's HTTP server and count - 1 more in processes of their own
    (_http_process), all on one port, each with a client of the engine process. Each HTTP
    process drains or stops on its own signals (Ctrl-C reaches them all); this one passes its own
    on, and stops them all when one of them, or the engine, has died."""
    from picovllm.entrypoints.openai.async_engine import frozen_heap, start_background_engine
    from picovllm.entrypoints.openai.server import build_app
    from picovllm.model_source.builtin import DEFAULT_MODEL
    from picovllm.sampling_params import SamplingParams

    defaults = {k: v for k, v in sampling_values(args).items() if k not in ("n", "logprobs", "ignore_eos")}
    SamplingParams(**defaults)  # invalid defaults fail here, not on every request
    sock = listen(args.host, args.port, reuse_port=count > 1)
    _say(f"loading {args.model or DEFAULT_MODEL}...")
    start = time.perf_counter()
    try:
        engine = start_background_engine(engine_kwargs(args), args.disable_frontend_multiprocessing, count)
    except BaseException:
        sock.close()
        raise
    name = args.served_model_name or args.model or DEFAULT_MODEL
    app_args = {
        "served_model_name": name,
        "api_key": args.api_key,
        "sampling_defaults": defaults,
        "web_ui": not args.disable_web_ui,
        "max_num_waiting": max_num_waiting(args),
        "kv_secret": args.kv_transfer_secret,
        "tool_call_parser": args.tool_call_parser,
        "enable_auto_tool_choice": args.enable_auto_tool_choice,
    }
    http_args = (args.log_level, not args.disable_uvicorn_access_log, args.disable_access_log_for_endpoints)
    app = build_app(engine, log_stats=not args.disable_log_stats, **app_args)
    try:
        address = (args.host, sock.getsockname()[1])
        others = start_http_processes(engine, address, app_args, http_args) if count > 1 else []
    except BaseException:
        engine.shutdown()
        sock.close()
        raise
    blocks = engine.get_metrics()["kv_blocks_total"]
    _say(
        f"ready in {time.perf_counter() - start:.1f} s: {name!r} ({blocks} KV blocks, max_model_len "
        f"{engine.max_model_len}{'' if engine.kv_role == 'both' else f', the {engine.kv_role} role'}"
        f"{f', {count} HTTP processes' if count > 1 else ''})\n"
        f"serving on http://{args.host}:{args.port}{'' if args.disable_web_ui else ' (open it for the chat page)'} "
        f"(Ctrl-C stops it; open streams get {GRACEFUL_SHUTDOWN_S} s to finish; SIGTERM drains)"
    )
    with frozen_heap():
        try:
            stopped = _serve_http(app, sock, *http_args, engine=engine, others=others)
        finally:
            engine.shutdown()
    return 0 if stopped else 1  # (1: the engine or an HTTP process died)


def start_http_processes(engine, address: tuple[str, int], app_args: dict, http_args: tuple = ("info",)) -> list:
    """serve's other HTTP processes (--api-server-count), one for each of the engine process's other
    clients (EngineProcess.clients), listening on address (a port of SO_REUSEPORT sockets) once
    this returns; the engine's copies of their pipes closed. RuntimeError if one exits first."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    pairs = engine.clients()
    started = [ctx.Event() for _ in pairs]
    others = [
        ctx.Process(target=_http_process, args=(pipes, address, app_args, http_args, up), name=f"picovllm-http-{i}")
        for i, (pipes, up) in enumerate(zip(pairs, started), 1)
    ]
    try:
        for p in others:
            p.start()
        engine.release_clients()
        for p, up in zip(others, started):
            while not up.wait(0.1):
                if not p.is_alive():
                    raise RuntimeError(f"HTTP process {p.name} exited while starting (code {p.exitcode})")
    except BaseException:
        for p in others:
            p.kill()
        raise
    return others


def _http_process(pipes: tuple, address: tuple[str, int], app_args: dict, http_args: tuple, started) -> None:
    """One more HTTP process of serve's (--api-server-count): its own app and client of the engine
    process, on a socket of its own on serve's port (listening before it sets `started`), until
    its signal or the engine's end; no stats lines (serve's own process logs them)."""
    from picovllm.entrypoints.openai.async_engine import EngineClient, frozen_heap
    from picovllm.entrypoints.openai.server import build_app

    configure_logging()
    sock = listen(*address, reuse_port=True)
    engine = EngineClient(*pipes)
    app = build_app(engine, log_stats=False, **app_args)
    sock.listen(2048)  # (uvicorn's backlog)
    started.set()
    with frozen_heap():
        try:
            _serve_http(app, sock, *http_args, engine=engine, quiet=True)
        finally:
            engine.close()


def _cmd_router(args: argparse.Namespace) -> int:
    import asyncio

    from picovllm.entrypoints.router import build_router_app, check_instances

    problems = asyncio.run(check_instances(args.prefill, args.decode, args.kv_transfer_secret))
    if problems:
        _say("picovllm router: " + "\n".join(problems))
        return 1
    sock = listen(args.host, args.port)
    app = build_router_app(
        args.prefill,
        args.decode,
        web_ui=not args.disable_web_ui,
        kv_secret=args.kv_transfer_secret,
        prefill_timeout_s=args.prefill_timeout_s,
        decode_timeout_s=args.decode_timeout_s,
        health_check_interval_s=args.health_check_interval_s,
    )
    _say(
        f"routing on http://{args.host}:{args.port}: prefill {', '.join(args.prefill)}; decode {', '.join(args.decode)}"
        " (SIGTERM drains)"
    )
    _serve_http(app, sock, "warning")  # (uvicorn's access lines: one a request the router relays)
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from picovllm.model_source.builtin import BUILTIN_MODELS, DEFAULT_MODEL, DUMMY_CONFIGS, is_installed

    for name, m in BUILTIN_MODELS.items():
        state = "installed" if is_installed(name) else f"not installed: {m.install}"
        print(f"{name}{' (default)' if name == DEFAULT_MODEL else ''}: {state}\n    {m.source}")
    print("random-weight shapes for benchmarks: " + ", ".join(f"dummy:{s}" for s in DUMMY_CONFIGS))
    return 0


_KV_SECRET_HELP = (
    "what a router proves itself to its prefill and decode instances with (kv_transfer_params are refused "
    "without it); the same on all of them; default: one made once for this user on this machine"
)


def _log_level_option(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"], help=help
    )


class _Parser(argparse.ArgumentParser):
    """A bad option is one line, and where the options are (argparse prints the usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n({self.prog} --help lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    from picovllm.bench.cli import add_bench_parser

    parser = _Parser(prog="picovllm", description="Pico-vLLM: a compact, fast LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    engine, sampling = engine_parser(), sampling_parser()

    gen = sub.add_parser(
        "generate",
        parents=[engine, sampling],
        help="complete prompts",
        description="Complete each prompt (arguments, or one per line of --file); defaults: "
        "--max-tokens 256 --temperature 0.7, under the model's generation config (--generation-config).",
    )
    gen.add_argument("prompts", nargs="*", help="prompts to complete")
    gen.add_argument("--file", "-f", help="a file with one prompt per line ('-' for stdin)")
    gen.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user chat message")
    gen.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        help="print only the completions (a blank line between two), no progress or summary",
    )
    gen.set_defaults(func=_cmd_generate, parser=gen)

    chat = sub.add_parser(
        "chat",
        parents=[engine, sampling],
        help="interactive chat, streamed",
        description="Chat interactively; replies stream as they are generated; defaults: "
        "--max-tokens 1024 --temperature 0.7, under the model's generation config (--generation-config).",
    )
    chat.add_argument("--system", default=None, help="a system prompt")
    chat.add_argument(
        "--tools",
        default=None,
        metavar="FILE",
        help="a JSON file of tools (OpenAI's format) the model may call; /tool RESULT answers a call",
    )
    chat.set_defaults(func=_cmd_chat, parser=chat)

    serve = sub.add_parser(
        "serve",
        parents=[engine, engine_parser("serve"), sampling, queue_parser()],
        help="OpenAI-compatible HTTP server",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, "
        "/metrics, /tokenize and /detokenize. Sampling options set the defaults "
        "of requests that leave them out (over the model's generation config: --generation-config).",
    )
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model (same as --model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=port, default=8000, help="port (default 8000)")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    serve.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    serve.add_argument("--disable-web-ui", action="store_true", help="no page at / (the chat playground and dashboard)")
    _log_level_option(serve, "what the server logs, and uvicorn (info)")
    serve.add_argument(
        "--disable-log-stats", action="store_true", help="no line of throughput and queues in the log every 10 s"
    )
    serve.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line for each request")
    serve.add_argument(
        "--disable-access-log-for-endpoints",
        default="",
        metavar="PATHS",
        help="no log line for requests to these paths, comma-separated (e.g. /health,/kv_transfer/info: "
        "what a router polls)",
    )
    serve.add_argument(
        "--disable-frontend-multiprocessing",
        action="store_true",
        help="run the engine on a thread of the server's process, not in a process of its own",
    )
    serve.add_argument(
        "--api-server-count",
        type=positive_int,
        default=1,
        help="HTTP processes sharing the port and the engine process (vLLM's): the streams' serialising spread "
        "over several cores; --max-num-waiting is split between them (default 1)",
    )
    serve.add_argument("--kv-transfer-secret", default=None, metavar="SECRET", help=_KV_SECRET_HELP)
    serve.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=True,
        help='tool_choice "auto" (the default with tools): the model\'s own tool calls parsed from its output',
    )
    serve.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=sorted(TOOL_PARSERS),
        help="the markup of the model's tool calls (hermes: Qwen2.5's <tool_call>...</tool_call>)",
    )
    serve.set_defaults(func=_cmd_serve, parser=serve)

    router = sub.add_parser(
        "router",
        help="front door of disaggregated serving: prefill on one instance, decode on another",
        description="An OpenAI-compatible server that sends each request's prompt to a prefill instance "
        "(serve --role prefill), then the request to a decode instance (serve --role decode), and streams "
        "the decode instance's answer back.",
    )
    router.add_argument("--prefill", action="append", required=True, metavar="URL", help="a prefill instance")
    router.add_argument("--decode", action="append", required=True, metavar="URL", help="a decode instance")
    router.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    router.add_argument("--port", type=port, default=8000, help="port (default 8000)")
    router.add_argument(
        "--disable-web-ui", action="store_true", help="no page at / (chat and the instances' dashboard)"
    )
    router.add_argument("--kv-transfer-secret", default=None, metavar="SECRET", help=_KV_SECRET_HELP)
    router.add_argument(
        "--prefill-timeout-s",
        type=positive_float,
        default=60.0,
        help="a prefill instance that has not answered within this many seconds is a 504 (60)",
    )
    router.add_argument(
        "--decode-timeout-s",
        type=positive_float,
        default=600.0,
        help="a decode instance that has sent no byte of its answer within this many seconds is a 504 (600; "
        "a streamed answer's first byte comes with its first token, another's with its end)",
    )
    router.add_argument(
        "--health-check-interval-s",
        type=positive_float,
        default=2.0,
        help="how often each instance's health is checked: one that fails is out until it passes (2)",
    )
    _log_level_option(router, "what the router logs (info; uvicorn's own lines: warnings)")
    router.set_defaults(func=_cmd_router, parser=router)

    models = sub.add_parser("models", help="list built-in models")
    models.set_defaults(func=_cmd_models, parser=models)

    add_bench_parser(sub, engine)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the subcommand's parser, with its usage
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    configure_logging(getattr(args, "log_level", "warning"))
    launched = envs.torchrun_ranks()
    try:
        if launched is not None and args.command == "bench" and args.bench == "prefix":
            raise ValueError("bench prefix builds two engines in turn, a torchrun launch one: use -tp without torchrun")
        if launched is not None and launched[0] > 0 and args.command in ("generate", "chat", "serve", "bench"):
            from picovllm.executor.torchrun import run_torchrun_rank  # this process is a tensor-parallel rank

            args.model = getattr(args, "model_tag", None) or args.model
            return run_torchrun_rank(engine_kwargs(args))
        return args.func(args)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
        print(f"picovllm {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # (Ctrl-C: what it started is stopped on the way out; serve says "stopped")
        _say("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
