"""The server's own OpenAPI schema, fuzzed for a minute by schemathesis (its CLI, against the
server on the tiny model): no response may be a server error (not_a_server_error), and data the
schema rules out must be rejected (negative_data_rejection)."""

import shutil
import subprocess

import httpx
import pytest
from conftest import make_llm

from picovllm.entrypoints.openai.async_engine import AsyncEngine
from picovllm.entrypoints.openai.server import build_app, serve_in_thread

FUZZ_S = 60
SCHEMATHESIS = shutil.which("schemathesis")
pytestmark = pytest.mark.skipif(SCHEMATHESIS is None, reason="the fuzz test needs schemathesis (the test extra)")


def test_a_minute_of_schema_fuzzing_finds_no_server_error(tiny_qwen, tmp_path):
    engine = AsyncEngine(make_llm(tiny_qwen[0], max_model_len=256).llm_engine)
    url, stop = serve_in_thread(build_app(engine, "tiny"))
    try:
        run = subprocess.run(
            [
                SCHEMATHESIS,
                "run",
                url + "/openapi.json",
                "--checks",
                "not_a_server_error,negative_data_rejection",
                "--max-time",
                str(FUZZ_S),
                "--workers",
                "1",
                "--continue-on-failure",
                "--seed",
                "1",
                "--report-dir",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=FUZZ_S + 120,
            cwd=tmp_path,  # (its caches, .schemathesis/ and .hypothesis/, go there, not into the checkout)
        )
        summary = run.stdout[-3000:]
        assert run.returncode == 0, summary
        assert " passed" in summary and "generated" in summary
        assert httpx.get(url + "/health").status_code == 200  # (and the server still serves)
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        stop()
        engine.shutdown()
