import dataclasses
import os
import signal
import sys

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in Triton's interpreter on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _round_fp8_as_the_gpu_does() -> None:
    """Triton's interpreter (3.7) rounds fp32 to e4m3 wrongly: a carry out of the mantissa is lost
    when the exponent's lowest bit is set (126.8 becomes 64, not 128), and ties round up. Its
    fp32 -> e4m3 casts here round as the GPU's do (to nearest even, as torch's cast)."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    convert = interpreter._convert_float

    def fixed(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
            values = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
            return values.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(input.shape)
        return convert(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = fixed


def _patch_the_language_once_a_launch() -> None:
    """Triton's interpreter (3.9) patches triton.language for a launch, and again at every call of a
    @triton.jit helper inside it (each time through every member of the language: ~2 ms, a quarter
    of an attention test's time). Within a launch, a helper's call patches only the language
    modules (tl, tl.core) the launch has not, into the launch's scope, which undoes them all."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch, launch = interpreter._patch_lang, []  # launch: [its scope, the modules patched] while one runs

    def langs(fn) -> set:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def once(fn):
        if launch:
            scope, patched = launch
            if langs(fn) - patched:
                scope._changes += patch(fn)._changes
                patched |= langs(fn)
            return interpreter._LangPatchScope()
        scope = patch(fn)
        launch[:] = [scope, langs(fn)]
        restore = scope.restore

        def undo():
            launch.clear()
            restore()

        scope.restore = undo
        return scope

    interpreter._patch_lang = once


def _check_no_overflow_as_the_gpu_does() -> None:
    """The interpreter checks every int32 add, sub and mul of a kernel for overflow (a sixth of an
    attention test's time), as a GPU kernel does only in Triton's debug mode; the GPU runs the
    kernels without, and the tests' indices are far from 2**31."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


if os.environ.get("TRITON_INTERPRET") == "1":
    _round_fp8_as_the_gpu_does()
    _patch_the_language_once_a_launch()
    _check_no_overflow_as_the_gpu_does()

# A shell without job control starts a background command with SIGINT ignored, and an ignored
# signal stays ignored across exec: the Ctrl-C tests' processes would never see it. With a handler
# here, the processes the tests start get the default action, as from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(min(2, torch.get_num_threads()))

from tiny_models import build_model  # noqa: E402


@pytest.fixture
def unreadable_seed(monkeypatch) -> int:
    """A seed whose requests' outputs cannot be read: OutputProcessor raises UnicodeDecodeError
    (injected) on them, as a tokenizer might."""
    from picovllm.engine.output_processor import OutputProcessor

    seed, real_append = 4242, OutputProcessor._append

    def append(self, st, c):
        if st.params.seed == seed:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real_append(self, st, c)

    monkeypatch.setattr(OutputProcessor, "_append", append)
    return seed


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory):
    """(path, HF model) of a tiny Qwen2: tied head, QKV bias, head_dim 16, 3 query heads per KV head."""
    path = str(tmp_path_factory.mktemp("tiny_qwen"))
    return path, build_model(path, "qwen2")


# the sampling settings a model's creator may recommend (Qwen2.5-Instruct's, temperature 0 here so
# that outputs can be compared), and a bound on max_tokens
GENERATION_CONFIG = {"temperature": 0.0, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 5}


@pytest.fixture(scope="session")
def tiny_qwen_generation_config(tiny_qwen, tmp_path_factory):
    """tiny_qwen's directory (its files linked) with GENERATION_CONFIG in its generation_config.json."""
    import json

    path = tmp_path_factory.mktemp("tiny_qwen_generation_config")
    for name in os.listdir(tiny_qwen[0]):
        if name != "generation_config.json":
            os.symlink(os.path.join(tiny_qwen[0], name), path / name)
    with open(os.path.join(tiny_qwen[0], "generation_config.json")) as f:
        config = {**json.load(f), "do_sample": True, **GENERATION_CONFIG}
    (path / "generation_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(path, HF model) of a tiny Llama: untied head, no bias."""
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    return path, build_model(path, "llama", tie=False, bias=False, seed=1)


# The suite runs on CPU (CI); scripts/gpu_check.sh runs it again with the engine on CUDA (and the
# engine tests that compare engines with each other, not with transformers, in bf16 too).
TEST_DEVICE = os.environ.get("PICOVLLM_TEST_DEVICE", "cpu")
TEST_DTYPE = os.environ.get("PICOVLLM_TEST_DTYPE", "float32")
# a test whose reference is transformers' (or the unquantized engine's) fp32, to fp32's rounding
FP32_ONLY = pytest.mark.skipif(TEST_DTYPE != "float32", reason="exact to fp32's rounding: PICOVLLM_TEST_DTYPE=float32")


def engine_args(path: str, **kwargs) -> dict:
    """The tests' engine options: TEST_DTYPE (fp32 unless set), a 16 MiB KV cache, on TEST_DEVICE."""
    return {
        "model": path,
        "dtype": TEST_DTYPE,
        "device": TEST_DEVICE,
        "kv_cache_memory": 16 << 20,
        "gpu_memory_utilization": 0.3,
        **kwargs,
    }


def need_nixl() -> None:
    """Skip the calling test module without NIXL; with it, NIXL between processes goes over loopback
    TCP (the engine processes inherit the setting)."""
    from picovllm.distributed.kv_transfer.nixl import nixl_api

    try:
        nixl_api()
    except ModuleNotFoundError as e:
        pytest.skip(str(e), allow_module_level=True)
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")


def make_llm(path: str, **kwargs):
    from picovllm import LLM

    return LLM(**engine_args(path, **kwargs))


def start_cli_server(*args: str, timeout: float = 60):
    """`picovllm ARGS --port P` in a process of its own, once its /health answers 200: (the
    process, its URL). Its stderr is a pipe."""
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cli = [sys.executable, "-m", "picovllm.entrypoints.cli", *args, "--port", str(port)]
    proc = subprocess.Popen(cli, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"picovllm {' '.join(args)} did not start: {proc.communicate()[1][-2000:]}")


def stop_cli_server(proc, how: str, timeout: float = 30, reap_s: float = 10) -> tuple[int, str]:
    """Signal `how` (SIGINT, SIGTERM) to a start_cli_server process: (its exit code, its stderr),
    once it has exited and every process it had started is gone (asserted, within reap_s)."""
    import signal

    import psutil

    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(getattr(signal, how))
    code = proc.wait(timeout=timeout)
    err = proc.stderr.read()
    gone, alive = psutil.wait_procs(children, timeout=reap_s)
    assert not alive, alive
    return code, err


def assert_group_gone(pgid: int, what: str, timeout: float = 10) -> None:
    """Every process of the group pgid has ended within timeout (the last may take a moment to be
    reaped)."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise AssertionError(f"a process of {what}'s group outlived it")
