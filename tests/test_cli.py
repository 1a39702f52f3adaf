"""The picovllm command line on a tiny model."""

import dataclasses
import io
import re
import sys

import pytest

from picovllm.entrypoints.cli import main

ENGINE = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", str(16 << 20)]


def test_help_lists_commands_and_options(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert all(c in text for c in ("generate", "chat", "bench", "models"))
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    assert all(f in text for f in ("--max-tokens", "--temperature", "--top-p", "--seed", "--model", "--dtype"))


def test_engine_options_are_declared_once(capsys):
    """EngineConfig's declarations make the parser (flag, default, type, range, choices) and
    docs/options.md; the config's own checks say the same as the parser's."""
    from pathlib import Path

    from picovllm.config import EngineConfig
    from picovllm.entrypoints.args import engine_kwargs, options_markdown
    from picovllm.entrypoints.cli import build_parser

    docs = Path(__file__).parent.parent / "docs" / "options.md"
    assert docs.read_text() == options_markdown(), "run: python -m picovllm.entrypoints.args > docs/options.md"
    args = build_parser().parse_args(
        ["serve", "--role", "decode", "-tp", "2", "--no-prefix-caching", "--kv-lease-s", "5"]
    )
    kwargs = engine_kwargs(args)
    assert kwargs["kv_role"] == "decode" and kwargs["tensor_parallel_size"] == 2 and kwargs["kv_lease_s"] == 5.0
    assert kwargs["enable_prefix_caching"] is False and kwargs["max_num_seqs"] == 256 and kwargs["async_scheduling"]
    assert "kv_role" not in engine_kwargs(build_parser().parse_args(["generate", "hi"]))  # (serve's alone)
    EngineConfig(**kwargs).validate()
    for flag, field, value in [
        ("--kv-lease-s", "kv_lease_s", 0.0),
        ("--mixed-graph-tokens", "mixed_graph_tokens", 9000),
    ]:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", flag, str(value)])
        said = capsys.readouterr().err.split("out of range: ")[1].splitlines()[0]
        with pytest.raises(ValueError, match=f"^{field} {re.escape(said)}, got {value}"):
            EngineConfig(**{field: value}).validate()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--role", "middle"])
    assert "invalid choice: 'middle'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_role must be 'prefill', 'decode' or 'both', got 'middle'"):
        EngineConfig(kv_role="middle").validate()
    import torch

    EngineConfig(dtype=torch.bfloat16, device=torch.device("cpu")).validate()  # (the Python API's types too)
    with pytest.raises(ValueError, match="dtype must be auto, bfloat16"):
        EngineConfig(dtype=torch.int8).validate()


def test_generate_prompts_and_file(tiny_qwen, tmp_path, capsys):
    from picovllm import LLM, SamplingParams

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello world\n\nThe capital of France is\n")
    rc = main(
        [
            "generate",
            "-m",
            tiny_qwen[0],
            *ENGINE,
            "--temperature",
            "0",
            "--max-tokens",
            "5",
            "--ignore-eos",
            "-q",
            "def add(a, b):",
            "--file",
            str(prompts),
        ]
    )
    assert rc == 0
    lines = capsys.readouterr().out.split("\n")
    llm = LLM(tiny_qwen[0], device="cpu", dtype="float32", kv_cache_memory=16 << 20)
    expected = llm.generate(
        ["def add(a, b):", "Hello world", "The capital of France is"],
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )
    joined = "\n".join(lines)
    for out in expected:
        assert out.outputs[0].text in joined


def test_chat_streams_and_keeps_history(tiny_qwen, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\nAnd again\n/exit\n"))
    rc = main(["chat", "-m", tiny_qwen[0], *ENGINE, "--temperature", "0", "--max-tokens", "4", "--ignore-eos"])
    assert rc == 0
    assert capsys.readouterr().out.count("> ") >= 3


def test_errors_are_messages_not_tracebacks(capsys):
    assert main(["generate", "-m", "/no/such/model", "--device", "cpu", "hi"]) == 1
    assert "not found" in capsys.readouterr().err
    assert main(["generate", "-m", "dummy:smollm2-135m", "--device", "cpu", "--presence-penalty", "5", "hi"]) == 1
    assert "presence_penalty" in capsys.readouterr().err


def test_models_lists_builtins_and_whether_they_are_installed(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-0.5b-instruct (default): installed" in out  # (the test command installs both)
    assert "smollm2-135m-instruct: installed" in out
    assert "qwen2.5-coder-1.5b-instruct: " in out and "pip install 'picovllm[" not in out


def test_bad_options_are_one_line_naming_the_subcommand_and_numbers_are_checked(capsys):
    for argv, said in [
        (["generate", "--bogus"], "unrecognized arguments: --bogus"),
        (["serve", "--port", "99999"], "a port is 1-65535"),
        (["serve", "--port", "0"], "a port is 1-65535"),
        (["generate", "--max-num-seqs", "0", "hi"], "must be >= 1"),
        (["chat", "--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
        (["generate", "--temperature", "x", "hi"], "'x' is not a number"),
        (["bench", "latency", "--batch-sizes", "1,0"], "must be >= 1"),
        (["generate", "--dtype", "float8", "hi"], "'float8': must be auto, bfloat16, float16 or float32"),
        (["serve", "--device", "tpu"], "'tpu': must be auto, cpu or cuda"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and said in err, (argv, err)
        prog = "picovllm " + " ".join(a for a in argv[:2] if not a.startswith("-"))
        first, pointer = err.splitlines()
        assert first.startswith(f"{prog}: error: ") and pointer == f"({prog} --help lists the options)", err


def test_prompts_are_checked_before_the_model_loads(tiny_qwen, tmp_path, monkeypatch, capsys):
    import picovllm

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(picovllm, "LLM", no_load)
    base = ["generate", "-m", tiny_qwen[0], *ENGINE]
    assert main([*base, ""]) == 1 and "the prompt is empty" in capsys.readouterr().err
    assert main([*base, "--max-model-len", "8", "word " * 20]) == 1 and "max_model_len" in capsys.readouterr().err
    assert main([*base, "--max-model-len", "64", "--max-tokens", "60", "Hello world"]) == 1
    assert "exceeds max_model_len" in capsys.readouterr().err
    assert main([*base, "--file", str(tmp_path / "missing.txt")]) == 1
    err = capsys.readouterr().err
    assert "cannot read --file" in err and "No such file" in err and "Errno" not in err


def test_generate_prints_a_start_up_line_and_a_summary(tiny_qwen, capsys):
    assert (
        main(
            [
                "generate",
                "-m",
                tiny_qwen[0],
                *ENGINE,
                "--temperature",
                "0",
                "--max-tokens",
                "6",
                "--ignore-eos",
                "Hello",
                "Hi there",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "loading " in err and "ready in" in err and "KV blocks" in err
    summary = [line for line in err.splitlines() if "tokens generated" in line]
    assert len(summary) == 1 and summary[0].startswith("2 prompts (") and ", 12 tokens generated in " in summary[0]
    assert "tok/s, time to first token" in summary[0] and summary[0].endswith("ms (mean)")


def test_quiet_generate_separates_completions(tiny_qwen, capsys):
    assert (
        main(
            [
                "generate",
                "-m",
                tiny_qwen[0],
                *ENGINE,
                "--temperature",
                "0",
                "--max-tokens",
                "3",
                "--ignore-eos",
                "-q",
                "Hello",
                "Hi there",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.count("\n\n") >= 1


def test_generate_takes_the_models_generation_config_under_its_flags(tiny_qwen_generation_config, capsys):
    """The model's temperature (0) over the command's own 0.7, its max_new_tokens (5) bounding the
    command's 256, and the command line's over both."""
    from picovllm import LLM

    llm = LLM(tiny_qwen_generation_config, device="cpu", dtype="float32", max_model_len=256)
    for flags, params in (
        ([], llm.get_default_sampling_params()),
        (["--max-tokens", "2"], dataclasses.replace(llm.get_default_sampling_params(), max_tokens=2)),
    ):
        expected = llm.generate("Hello", dataclasses.replace(params, ignore_eos=True), use_tqdm=False)
        argv = ["generate", "-m", tiny_qwen_generation_config, *ENGINE, *flags, "--ignore-eos", "-q", "Hello"]
        assert main(argv) == 0
        assert capsys.readouterr().out.strip() == expected[0].outputs[0].text.strip()


def test_chat_reset_says_so_and_replies_carry_their_speed(tiny_qwen, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n/reset\n/exit\n"))
    assert main(["chat", "-m", tiny_qwen[0], *ENGINE, "--temperature", "0", "--max-tokens", "4", "--ignore-eos"]) == 0
    err = capsys.readouterr().err
    assert "(conversation cleared)" in err and "(4 tokens, time to first token " in err and "tok/s)" in err


def test_generate_streams_one_prompt_and_shows_logprobs(tiny_qwen, capsys):
    from picovllm import LLM, SamplingParams

    argv = ["generate", "-m", tiny_qwen[0], *ENGINE, "--temperature", "0", "--max-tokens", "5", "--ignore-eos"]
    assert main([*argv, "--logprobs", "2", "Hello"]) == 0
    out = capsys.readouterr().out
    llm = LLM(tiny_qwen[0], device="cpu", dtype="float32", kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    expected = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
    head = f"--- 'Hello' [0]\nHello{expected.text}\n(5 tokens, length)\n"
    assert out.startswith(head), out
    for line, token, entries in zip(out[len(head) :].splitlines(), expected.token_ids, expected.logprobs, strict=True):
        chosen = entries.pop(token)
        assert len(entries) == 1  # (greedy: the sampled token is the first of the top 2)
        (other,) = entries.values()
        assert (
            line
            == f"  {chosen.decoded_token!r} {chosen.logprob:.3f}  (others: {other.decoded_token!r} {other.logprob:.3f})"
        )
    assert main(["chat", "-m", tiny_qwen[0], *ENGINE, "--n", "3"]) == 1
    assert "chat keeps one conversation: --n must be 1" in capsys.readouterr().err
