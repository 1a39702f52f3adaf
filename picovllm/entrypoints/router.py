"""`picovllm router`: the OpenAI-compatible front door of disaggregated serving. Each completion or
chat request goes to a prefill instance (`serve --role prefill`) as a one-token request with
kv_transfer_params {"do_remote_decode": true}; the answer's kv_transfer_params (where its KV is
held) go with the original request to a decode instance (`serve --role decode`), whose answer,
streamed or not, goes back to the client unchanged. Each instance is picked as the one with the
fewest requests in flight from this router (round-robin among equals).

Errors are OpenAI error JSON: a prefill instance's refusal (bad input) is passed back as it came,
its failure (5xx) is a 502, and so is an instance that cannot be reached within CONNECT_TIMEOUT_S
(the request is not retried elsewhere: its prompt may be half-computed there). A client that
disconnects closes the decode request, which aborts it there. A request with several prompts goes
to a decode instance alone, which prefills them itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from picovllm.entrypoints.web import mount_web_ui

CONNECT_TIMEOUT_S = 5.0


class _Instance:
    def __init__(self, url: str, role: str):
        self.url, self.role = url.rstrip("/"), role
        self.in_flight = 0


class _Pool:
    """The instances of one role; pick() the least loaded, round-robin among equals."""

    def __init__(self, urls: list[str], role: str):
        self.instances = [_Instance(u, role) for u in urls]
        self._turn = itertools.count()

    def pick(self) -> _Instance:
        least = min(i.in_flight for i in self.instances)
        candidates = [i for i in self.instances if i.in_flight == least]
        return candidates[next(self._turn) % len(candidates)]


def _auth(request: Request) -> dict:
    """The client's Authorization header, passed on to the instances (their --api-key)."""
    return {k: v for k, v in request.headers.items() if k.lower() == "authorization"}


def _error(status: int, message: str, type_: str = "BadGatewayError", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}}, status)


class _Unreachable(Exception):
    def __init__(self, instance: _Instance, error: BaseException):
        super().__init__(f"the {instance.role} instance {instance.url} is unreachable: {type(error).__name__}: {error}")


def build_router_app(prefill_urls: list[str], decode_urls: list[str], web_ui: bool = True) -> FastAPI:
    if not prefill_urls or not decode_urls:
        raise ValueError("the router needs at least one --prefill and one --decode instance")
    prefill, decode = _Pool(prefill_urls, "prefill"), _Pool(decode_urls, "decode")
    registry = CollectorRegistry()
    requests = Counter("router_requests", "requests by outcome", ["outcome"], registry=registry)
    prefill_s = Histogram(
        "router_prefill_seconds", "time to the prefill instance's answer", registry=registry, buckets=_BUCKETS
    )
    ttft = Histogram("router_time_to_first_byte_seconds", "time to the decode answer's first bytes", registry=registry)
    itl = Histogram(
        "router_inter_chunk_seconds", "time between a streamed answer's chunks", registry=registry, buckets=_BUCKETS
    )
    session: dict[str, aiohttp.ClientSession] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        session["s"] = aiohttp.ClientSession(timeout=timeout)
        yield
        await session["s"].close()

    app = FastAPI(title="Pico-vLLM router", lifespan=lifespan)

    async def forward(path: str, request: Request):
        try:
            body = await request.json()
        except json.JSONDecodeError:
            requests.labels("bad_request").inc()
            return _error(400, "invalid JSON in the request body", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "BadRequestError")
        if "kv_transfer_params" in body:
            return _error(400, "kv_transfer_params are the router's to set", "BadRequestError", "kv_transfer_params")
        headers = _auth(request)
        start = time.perf_counter()
        try:
            if isinstance(body.get("prompt"), list) and body["prompt"] and not isinstance(body["prompt"][0], int):
                kv = None  # several prompts: the decode instance prefills them itself
            else:
                kv, refusal = await _prefill(session["s"], prefill.pick(), path, body, headers)
                if refusal is not None:
                    requests.labels("refused").inc()
                    return refusal
                prefill_s.observe(time.perf_counter() - start)
            timers = (start, ttft, itl, requests)
            return await _decode(session["s"], decode.pick(), path, body, kv, headers, timers)
        except _Unreachable as e:
            requests.labels("unreachable").inc()
            return _error(502, str(e))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await forward("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request):
        instance = decode.pick()
        headers = _auth(request)
        try:
            async with session["s"].get(instance.url + "/v1/models", headers=headers) as r:
                return Response(await r.read(), r.status, media_type=r.content_type)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return _error(502, str(_Unreachable(instance, e)))

    @app.get("/health")
    async def health():
        """200 when every instance answers its /health with 200; else 503 naming those that do not."""
        instances = prefill.instances + decode.instances

        async def ok(i: _Instance) -> bool:
            try:
                async with session["s"].get(i.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    return r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False

        states = await asyncio.gather(*(ok(i) for i in instances))
        down = [i.url for i, up in zip(instances, states) if not up]
        return JSONResponse({"down": down}, 503) if down else Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def stats() -> dict:
        """Each instance's /stats (the dashboard; an instance that does not answer: its error)."""
        instances = prefill.instances + decode.instances

        async def one(i: _Instance) -> dict:
            try:
                async with session["s"].get(i.url + "/stats", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    return {"url": i.url, **(await r.json())}
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                return {"url": i.url, "error": str(_Unreachable(i, e))}

        return {"instances": list(await asyncio.gather(*(one(i) for i in instances)))}

    mount_web_ui(app, stats, web_ui)
    return app


# what the decode instance's answer alone needs (min_tokens would not even fit one token)
_NOT_FOR_PREFILL = ("stream", "stream_options", "logprobs", "top_logprobs", "echo", "min_tokens")
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


async def _prefill(session, instance: _Instance, path: str, body: dict, headers: dict):
    """The prompt through a prefill instance: (its kv_transfer_params, None), or (None, the error
    response to pass back)."""
    first = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    first.update(max_tokens=1, n=1, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in first:
        first["max_completion_tokens"] = 1
    instance.in_flight += 1
    try:
        async with session.post(instance.url + path, json=first, headers=headers) as r:
            answer = await r.read()
            if r.status >= 500:  # (the instance's engine failed: not the client's doing)
                return None, _error(502, f"the prefill instance {instance.url} failed: {answer.decode()[:500]}")
            if r.status != 200:  # (the client's request, refused: passed back as it came)
                return None, Response(answer, r.status, media_type=r.content_type)
            return json.loads(answer)["kv_transfer_params"], None
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise _Unreachable(instance, e) from None
    finally:
        instance.in_flight -= 1


async def _decode(session, instance: _Instance, path: str, body: dict, kv, headers, timers):
    """The request through a decode instance, its answer streamed back as it comes; timers:
    (the request's start, the first-byte and inter-chunk histograms, the outcome counter)."""
    start, ttft, itl, requests = timers
    if kv is not None:
        body = {**body, "kv_transfer_params": kv}
    instance.in_flight += 1
    try:
        response = await session.post(instance.url + path, json=body, headers=headers)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        instance.in_flight -= 1
        raise _Unreachable(instance, e) from None

    async def relay():
        last = None
        try:
            async for chunk in response.content.iter_any():
                now = time.perf_counter()
                if last is None:
                    ttft.observe(now - start)
                else:
                    itl.observe(now - last)
                last = now
                yield chunk
            requests.labels("ok" if response.status == 200 else "error").inc()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # the decode instance went away mid-answer
            requests.labels("broken").inc()
            if body.get("stream"):
                error = {"error": {"message": str(_Unreachable(instance, e)), "type": "BadGatewayError", "code": 502}}
                yield f"data: {json.dumps(error)}\n\n".encode()
        finally:
            response.close()  # (before its end: the decode instance sees the client go, and aborts)
            instance.in_flight -= 1

    return StreamingResponse(relay(), response.status, media_type=response.content_type)
