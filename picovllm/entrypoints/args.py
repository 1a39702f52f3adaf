"""The options every command shares: engine options (EngineConfig's fields) and sampling options
(SamplingParams' fields), as argparse parents, each number checked when it is parsed."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import fields

from picovllm.config import Bounds, EngineConfig, choices, field_type
from picovllm.sampling_params import SamplingParams


def _number(kind: type, bounds: Bounds, what: str = "") -> Callable[[str], int | float]:
    """An argparse type: a number of this kind within bounds (what: the message when it is not)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not bounds.admits(value):
            raise argparse.ArgumentTypeError(f"{text} is out of range: {what or bounds}")
        return value

    return parse


positive_int = _number(int, Bounds(1))
non_negative_int = _number(int, Bounds(0))
port = _number(int, Bounds(1, 65535), what="a port is 1-65535")
fraction = _number(float, Bounds(0, 1, low_open=True))
non_negative_float = _number(float, Bounds(0))
positive_float = _number(float, Bounds(0, low_open=True))

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
        _number(float, Bounds(0, 1)),
        "drop tokens below min_p times the most likely token's probability",
    ),
    (
        "--repetition-penalty",
        "repetition_penalty",
        positive_float,
        "penalise tokens already in the prompt or output (1: off)",
    ),
    ("--presence-penalty", "presence_penalty", float, "penalise tokens already in the output (0: off)"),
    ("--frequency-penalty", "frequency_penalty", float, "penalise tokens by their count in the output (0: off)"),
    ("--seed", "seed", non_negative_int, "random seed of the sampler (and of the engine)"),
    ("--n", "n", positive_int, "completions per prompt"),
    ("--logprobs", "logprobs", non_negative_int, "return this many top log-probabilities per token"),
]


def engine_parser(scope: str = "engine") -> argparse.ArgumentParser:
    """EngineConfig's options of this scope ("engine": every command's; "serve": the server's),
    from their declarations (config.option)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("engine options" if scope == "engine" else "disaggregated serving")
    for f in engine_options(scope):
        g.add_argument(*flags(f), dest=f.name, **_argument(f))
    return p


def engine_options(scope: str | None = None) -> list:
    """EngineConfig's fields that are command-line options (of one scope, or all)."""
    return [f for f in fields(EngineConfig) if f.metadata["help"] and scope in (None, f.metadata["scope"])]


def flags(f) -> tuple[str, ...]:
    return f.metadata["flags"] or ("--" + f.name.replace("_", "-"),)


def _argument(f) -> dict:
    """add_argument's keywords for an EngineConfig field (its type, range and choices checked as
    the command line is parsed)."""
    kind, _ = field_type(f)
    help_ = f.metadata["help"]
    if kind is bool:
        if flags(f)[0].startswith("--no-"):
            return dict(action="store_false", help=help_)
        return dict(action=argparse.BooleanOptionalAction, default=f.default, help=help_)
    if f.default is not None:
        help_ += f" (default: {f.default})"
    if (values := choices(kind)) is not None:
        return dict(choices=list(values), default=f.default, help=help_)
    bounds, check = f.metadata["bounds"], f.metadata["check"]
    typ = kind if bounds is None else _number(kind, bounds)
    if check is not None:
        typ = functools.partial(_checked, check)
    return dict(type=typ, default=f.default, help=help_)


def _checked(check, text: str) -> str:
    """An argparse type: text if check finds nothing wrong with it."""
    if (problem := check(text)) is not None:
        raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
    return text


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
    """The requests each HTTP process lets wait: --max-num-waiting (default 8 x --max-num-seqs),
    split between the --api-server-count processes (rounded up)."""
    total = args.max_num_waiting if args.max_num_waiting is not None else 8 * args.max_num_seqs
    return -(-total // getattr(args, "api_server_count", 1))


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig options a command's parser has (serve's include its own scope's)."""
    kwargs = {f.name: getattr(args, f.name) for f in engine_options() if hasattr(args, f.name)}
    if getattr(args, "seed", None) is not None:
        kwargs["seed"] = args.seed
    return kwargs


def sampling_values(args: argparse.Namespace) -> dict:
    """The sampling options given on the command line, by SamplingParams field."""
    values = {name: getattr(args, name) for _, name, _, _ in SAMPLING_FLAGS if getattr(args, name) is not None}
    if args.stop:
        values["stop"] = args.stop
    if args.ignore_eos:
        values["ignore_eos"] = True
    return values


def sampling_params(args: argparse.Namespace, model_defaults: dict | None = None, **defaults) -> SamplingParams:
    """The command line's sampling options, over the model's (its generation config's:
    LLMEngine.sampling_defaults), over the command's own defaults; the model's max_tokens bounds
    the command's."""
    model = dict(model_defaults or {})
    if "max_tokens" in model and "max_tokens" in defaults:
        model["max_tokens"] = min(model["max_tokens"], defaults["max_tokens"])
    return SamplingParams(**{**defaults, **model, **sampling_values(args)})


def options_markdown() -> str:
    """docs/options.md: the engine's options as a table (`python -m picovllm.entrypoints.args`
    writes it; a test keeps it equal to this)."""
    lines = [
        "# Engine options",
        "",
        "Made from `EngineConfig` (picovllm/config.py) by `python -m picovllm.entrypoints.args > docs/options.md`.",
        "Each is a keyword of `LLM(...)` and a flag of every command (those under *serve* of `picovllm serve`",
        "alone); numbers and choices are checked as the command line is parsed, and again by the engine.",
        "",
        "| option | flag | default | |",
        "|---|---|---|---|",
    ]
    for f in engine_options():
        kind, _ = field_type(f)
        values = choices(kind)
        names = list(flags(f))
        if kind is bool and not names[0].startswith("--no-"):
            names.append("--no-" + names[0][2:])
        flag = ", ".join(f"`{x}`" for x in names) + (f" `{{{','.join(values)}}}`" if values else "")
        where = " (serve)" if f.metadata["scope"] == "serve" else ""
        default = "" if f.default is None else f"`{f.default}`"
        lines.append(f"| `{f.name}` | {flag}{where} | {default} | {f.metadata['help']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(options_markdown(), end="")
