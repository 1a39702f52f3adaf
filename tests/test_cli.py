"""The picovllm command line on a tiny model."""
import io
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


def test_generate_prompts_and_file(tiny_qwen, tmp_path, capsys):
    from picovllm import LLM, SamplingParams
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello world\n\nThe capital of France is\n")
    rc = main(["generate", "-m", tiny_qwen[0], *ENGINE, "--temperature", "0", "--max-tokens", "5", "--ignore-eos",
               "-q", "def add(a, b):", "--file", str(prompts)])
    assert rc == 0
    lines = capsys.readouterr().out.split("\n")
    llm = LLM(tiny_qwen[0], device="cpu", dtype="float32", kv_cache_memory=16 << 20)
    expected = llm.generate(["def add(a, b):", "Hello world", "The capital of France is"],
                            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
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
    assert main(["generate", "-m", "dummy:smollm2-135m", "--device", "cpu", "--temperature", "-1", "hi"]) == 1
    assert "temperature" in capsys.readouterr().err


def test_models_lists_builtins(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-0.5b-instruct (default)" in out and "smollm2-135m-instruct" in out
