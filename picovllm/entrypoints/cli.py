"""The `picovllm` command: generate, chat, bench, models."""
from __future__ import annotations

import argparse
import sys

from picovllm.sampling_params import SamplingParams

# (flag, SamplingParams field, type, help)
_SAMPLING_FLAGS = [
    ("--max-tokens", "max_tokens", int, "maximum number of tokens to generate per completion (default 256)"),
    ("--min-tokens", "min_tokens", int, "generate at least this many tokens before EOS or stop"),
    ("--temperature", "temperature", float, "sampling temperature; 0 is greedy (default 0.7)"),
    ("--top-p", "top_p", float, "nucleus sampling: keep the most likely tokens up to this probability mass"),
    ("--top-k", "top_k", int, "keep only the k most likely tokens (0 or -1: off)"),
    ("--min-p", "min_p", float, "drop tokens below min_p times the most likely token's probability"),
    ("--repetition-penalty", "repetition_penalty", float, "penalise tokens already in the prompt or output (1: off)"),
    ("--presence-penalty", "presence_penalty", float, "penalise tokens already in the output (0: off)"),
    ("--frequency-penalty", "frequency_penalty", float, "penalise tokens by their count in the output (0: off)"),
    ("--seed", "seed", int, "random seed of the sampler (and of the engine)"),
    ("--n", "n", int, "completions per prompt"),
    ("--logprobs", "logprobs", int, "return this many top log-probabilities per token"),
]


def _engine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("engine options")
    g.add_argument("--model", "-m", default=None,
                   help="a local Hugging Face directory, a .gguf file, a built-in model name (see `picovllm "
                        "models`) or dummy:SHAPE for random weights; default: qwen2.5-coder-0.5b-instruct")
    g.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32 (default: the checkpoint's)")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda (default: cuda when available)")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output, in tokens")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests in a batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of a step, decodes and prefill chunks together (default 8192)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill long prompts over several steps, mixed with decodes")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="launch each step before the previous one's tokens are read (default: on)")
    g.add_argument("--mixed-graph-tokens", type=int, default=512,
                   help="replay steps with prompt tokens of up to this many tokens from CUDA graphs too "
                        "(0: eager)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights, activations and KV cache")
    g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache; overrides --gpu-memory-utilization (default on CPU: 2 GiB)")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                   help="run decode eagerly instead of replaying CUDA graphs captured at start-up (GPU only)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn prefix caching off")
    return p


def _sampling_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("sampling options")
    for flag, _, typ, help_ in _SAMPLING_FLAGS:
        g.add_argument(flag, type=typ, default=None, help=help_)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")
    return p


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = dict(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                  kv_cache_memory=args.kv_cache_memory, enforce_eager=args.enforce_eager,
                  enable_prefix_caching=args.enable_prefix_caching,
                  enable_chunked_prefill=args.enable_chunked_prefill, mixed_graph_tokens=args.mixed_graph_tokens,
                  async_scheduling=args.async_scheduling)
    if getattr(args, "seed", None) is not None:
        kwargs["seed"] = args.seed
    return kwargs


def sampling_params(args: argparse.Namespace, **defaults) -> SamplingParams:
    values = {**defaults}
    for _, name, _, _ in _SAMPLING_FLAGS:
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.stop:
        values["stop"] = args.stop
    values["ignore_eos"] = args.ignore_eos
    return SamplingParams(**values)


def _cmd_generate(args: argparse.Namespace) -> int:
    from picovllm import LLM

    prompts = list(args.prompts)
    if args.file:
        with (sys.stdin if args.file == "-" else open(args.file)) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("picovllm generate: give prompts as arguments or with --file", file=sys.stderr)
        return 2
    params = sampling_params(args, max_tokens=256, temperature=0.7)
    llm = LLM(**engine_kwargs(args))
    if args.chat_template:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=not args.quiet)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    for prompt, out in zip(prompts, outputs):
        for completion in out.outputs:
            if args.quiet:
                print(completion.text)
            else:
                print(f"--- {prompt!r} [{completion.index}] ({len(completion.token_ids)} tokens, "
                      f"{completion.finish_reason})\n{prompt if not args.chat_template else ''}{completion.text}")
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from picovllm import LLMEngine

    engine = LLMEngine.from_engine_args(**engine_kwargs(args))
    if engine.tokenizer is None or not engine.tokenizer.chat_template:
        print("picovllm chat: this model has no chat template", file=sys.stderr)
        return 2
    params = sampling_params(args, max_tokens=1024, temperature=0.7)
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    print("Chat with the model. /reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if user.strip() == "/exit":
            return 0
        if user.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not user.strip():
            continue
        history.append({"role": "user", "content": user})
        text = engine.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        try:
            rid = engine.add_request(None, ids, params)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        shown = 0
        reply = ""
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    reply = out.outputs[0].text
                    print(reply[shown:], end="", flush=True)
                    shown = len(reply)
        except KeyboardInterrupt:
            engine.abort_request(rid)
        print()
        history.append({"role": "assistant", "content": reply})


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from picovllm.entrypoints.openai.async_engine import frozen_heap, start_background_engine
    from picovllm.entrypoints.openai.server import build_app
    from picovllm.model.loader.builtin import DEFAULT_MODEL

    args.model = args.model_tag or args.model
    defaults = {name: getattr(args, name) for _, name, _, _ in _SAMPLING_FLAGS
                if getattr(args, name) is not None and name not in ("n", "logprobs")}
    if args.stop:
        defaults["stop"] = args.stop
    SamplingParams(**defaults)  # invalid defaults fail here, not on every request
    engine = start_background_engine(engine_kwargs(args), args.disable_frontend_multiprocessing)
    app = build_app(engine, args.served_model_name or args.model or DEFAULT_MODEL, args.api_key, defaults)
    with frozen_heap():
        try:
            uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
        finally:
            engine.shutdown()
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from picovllm.model.loader.builtin import BUILTIN_MODELS, DEFAULT_MODEL, DUMMY_CONFIGS

    for name, m in BUILTIN_MODELS.items():
        print(f"{name}{' (default)' if name == DEFAULT_MODEL else ''}\n    {m.source}\n    install: {m.install}")
    print("random-weight shapes for benchmarks: " + ", ".join(f"dummy:{s}" for s in DUMMY_CONFIGS))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="picovllm", description="Pico-vLLM: a compact, fast LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    engine, sampling = _engine_parser(), _sampling_parser()

    gen = sub.add_parser("generate", parents=[engine, sampling], help="complete prompts",
                         description="Complete each prompt (arguments, or one per line of --file).")
    gen.add_argument("prompts", nargs="*", help="prompts to complete")
    gen.add_argument("--file", "-f", help="a file with one prompt per line ('-' for stdin)")
    gen.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user chat message")
    gen.add_argument("--quiet", "-q", action="store_true", help="print only the completions, no progress bar")
    gen.set_defaults(func=_cmd_generate)

    chat = sub.add_parser("chat", parents=[engine, sampling], help="interactive chat, streamed",
                          description="Chat interactively; replies stream as they are generated.")
    chat.add_argument("--system", default=None, help="a system prompt")
    chat.set_defaults(func=_cmd_chat)

    serve = sub.add_parser("serve", parents=[engine, sampling], help="OpenAI-compatible HTTP server",
                           description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, "
                                       "/metrics, /tokenize and /detokenize. Sampling options set the defaults "
                                       "of requests that leave them out.")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model (same as --model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    serve.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    serve.add_argument("--log-level", default="info", help="uvicorn log level")
    serve.add_argument("--disable-frontend-multiprocessing", action="store_true",
                       help="run the engine on a thread of the server's process, not in a process of its own")
    serve.set_defaults(func=_cmd_serve)

    models = sub.add_parser("models", help="list built-in models")
    models.set_defaults(func=_cmd_models)

    from picovllm.bench.cli import add_bench_parser
    add_bench_parser(sub, engine)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
        print(f"picovllm {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
