"""The OpenAI-compatible HTTP server (FastAPI): the app, its error handlers and its routers
(routers/: completions, chat, tokenize, admin).

Errors are OpenAI error JSON: 400 for invalid parameters, 401 without the API key, 404 for an
unknown model, 503 with Retry-After when max_num_waiting requests wait already, and 500
(internal_error) for anything that escapes a route (its traceback logged). A streaming client
that disconnects aborts its request, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import threading
import time
from collections.abc import Callable

from fastapi import APIRouter, Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from picovllm.entrypoints.openai.async_engine import AsyncEngine, EngineClient
from picovllm.entrypoints.openai.metrics import ServerMetrics
from picovllm.entrypoints.openai.routers import admin, chat, completions, kv_transfer, tokenize
from picovllm.entrypoints.openai.serving import (
    APIError,
    ClientGone,
    ServerState,
    authorize,
    error_response,
    http_error,
    kv_transfer_secret,
)
from picovllm.entrypoints.web import StatsHistory, mount_web_ui


async def _api_error(_, exc: APIError) -> JSONResponse:
    response = error_response(exc.status, exc.message, exc.type, exc.param)
    response.headers.update(exc.headers)
    return response


async def _client_gone(_, exc: ClientGone) -> Response:
    return Response(status_code=499)  # (nginx's "client closed request": nobody reads it)


async def _internal_error(_, exc: Exception) -> JSONResponse:
    """What escaped a route: an OpenAI error, never a bare 500 (uvicorn logs the traceback)."""
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")


async def _validation_error(_, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":  # (its location is a character offset, not a field)
        return error_response(
            400, f"invalid JSON in the request body: {first.get('ctx', {}).get('error', exc)}", "BadRequestError"
        )
    param = _param(first.get("loc", ())[1:])
    where = f"request: {param}" if param else "request body"  # (None: the body itself, not a field)
    return error_response(400, f"invalid {where}: {first.get('msg', exc)}", "BadRequestError", param)


def _param(loc: tuple) -> str | None:
    """The dotted path of the field (list indices included), without the union members pydantic
    names on the way ('list[int]', 'str', ...: no field is called that)."""
    union_members = {"str", "int", "float", "bool", "list", "dict", "none"}
    parts = [str(x) for x in loc if isinstance(x, int) or (x.isidentifier() and x not in union_members)]
    return ".".join(parts) or None


async def _pickups(engine: AsyncEngine | EngineClient) -> None:
    """On the way out (the requests done): a prefill instance waits until decode instances have
    pulled the KV it holds, or its leases have ended (the engine ends them), as long as the engine
    lives."""
    deadline = time.monotonic() + engine.kv_lease_s + 1
    while engine.error is None and time.monotonic() < deadline:
        if not engine.get_metrics().get("kv_blocks_held_for_pickup"):
            return
        await asyncio.sleep(0.05)


def build_app(
    engine: AsyncEngine | EngineClient,
    served_model_name: str,
    api_key: str | None = None,
    sampling_defaults: dict | None = None,
    web_ui: bool = True,
    max_num_waiting: int | None = None,
    kv_secret: str | None = None,
    tool_call_parser: str = "hermes",
    enable_auto_tool_choice: bool = True,
    log_stats: bool = True,
) -> FastAPI:
    """The server's app; sampling_defaults: what requests leave out (serve's sampling flags, over
    the engine's own from the model's generation config); web_ui: the page at / (entrypoints/web),
    with the dashboard's /stats (served either way); max_num_waiting: requests that may wait for
    the engine (None: no bound); kv_secret: a prefill or decode instance's --kv-transfer-secret
    (see kv_transfer_secret); tool_call_parser, enable_auto_tool_choice: tool calling
    (entrypoints/openai/tool_calls.py); log_stats: a line of throughput and queues in the log every
    few seconds (entrypoints/web)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if isinstance(engine, EngineClient):  # its steps are read on this loop from the start
            engine.attach()
        async with history.sampling():
            yield
            await _pickups(engine)

    app = FastAPI(title="Pico-vLLM OpenAI-compatible server", lifespan=lifespan)
    metrics = ServerMetrics(engine.get_metrics)
    secret = kv_transfer_secret(kv_secret) if engine.kv_role != "both" else None
    app.state.server = ServerState(
        engine,
        served_model_name,
        api_key,
        {**engine.sampling_defaults, **(sampling_defaults or {})},
        metrics,
        max_num_waiting,
        secret,
        tool_call_parser,
        enable_auto_tool_choice,
    )
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(Exception, _internal_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    # The key is checked by a dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware
    # relays every streamed chunk through a task and a memory stream, which cost more than the
    # rest of the server's work per token.
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])
    for router in (completions.router, chat.router, admin.v1_router):
        v1.include_router(router)
    app.include_router(v1)
    app.include_router(admin.router)
    app.include_router(tokenize.router)
    app.include_router(kv_transfer.router)
    history = StatsHistory(lambda: metrics.snapshot(engine.get_metrics()), log_stats)
    mount_web_ui(app, lambda: {"model": served_model_name, "role": engine.kv_role, **history.stats()}, web_ui)
    return app


def serve_in_thread(
    app: FastAPI, host: str = "127.0.0.1", port: int = 0, sock: socket.socket | None = None
) -> tuple[str, Callable[[], None]]:
    """Run the app under uvicorn on a background thread (port 0: a free one; or on sock, bound);
    returns its URL and a function that stops it. For tests and the serving benchmark."""
    import uvicorn

    if sock is not None:
        host, port = sock.getsockname()[:2]
    elif port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    run = server.run if sock is None else functools.partial(server.run, sockets=[sock])
    thread = threading.Thread(target=run, name="picovllm-http", daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started and thread.is_alive() and time.time() < deadline:
        time.sleep(0.02)
    if not server.started:
        raise RuntimeError(f"the server did not start on {host}:{port}")

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)

    return f"http://{host}:{port}", stop
