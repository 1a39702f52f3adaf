"""`picovllm router`: the OpenAI-compatible front door of disaggregated serving. Each completion or
chat request goes to a prefill instance (`serve --role prefill`) as a one-token request with
kv_transfer_params {"do_remote_decode": true}; the answer's kv_transfer_params (where its KV is
held) go with the original request to a decode instance (`serve --role decode`), whose answer,
streamed or not, goes back to the client unchanged. Each instance is picked as the one with the
fewest requests in flight from this router (round-robin among equals) among those that are up.
The router proves itself to its instances with a shared secret (serving.KV_SECRET_HEADER).

Instances: a health check every health_check_interval_s (GET /health, then /kv_transfer/info: the
instance's role and what its KV is) takes an instance out when it fails, and puts it back when it
passes; so does a run of FAILURES_TO_EJECT failed requests (a circuit breaker). An instance of the
wrong role, or whose KV is not the others' (another model, dtype or layout: its KV would decode
into garbage), stays out; `picovllm router` refuses to start with one. A request whose connection
was refused (it never reached the instance) is retried once on another one.

Errors are OpenAI error JSON: a prefill instance's refusal (bad input) is passed back as it came,
its failure (5xx, or an answer without kv_transfer_params) is a 502, and so is an instance that
cannot be reached within CONNECT_TIMEOUT_S; no answer from the prefill instance within
prefill_timeout_s, or no first byte from the decode instance within decode_timeout_s, is a 504
(not retried elsewhere: the prompt may be half-computed there). Whenever the decode instance does
not answer a request whole (it refused or failed, the client left), the router releases the
prompt's KV on the prefill instance at once; a client that disconnects closes the decode request,
which aborts it there. A request with several prompts goes to a decode instance alone, which
prefills them itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from dataclasses import dataclass, replace

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from picovllm.entrypoints.openai.protocol import STRUCTURED_FIELDS
from picovllm.entrypoints.openai.serving import (
    KV_SECRET_HEADER,
    ClientGone,
    cancel_on_disconnect,
    error_response,
    http_error,
    kv_transfer_secret,
)
from picovllm.entrypoints.web import mount_web_ui
from picovllm.kv_transfer_params import KVTransferParams

logger = logging.getLogger("picovllm")

CONNECT_TIMEOUT_S = 5.0
HEALTH_TIMEOUT_S = 2.0  # an instance's /health and /kv_transfer/info, each
FAILURES_TO_EJECT = 3  # failed requests in a row that take an instance out until its health check passes


class _Instance:
    def __init__(self, url: str, role: str):
        self.url, self.role = url.rstrip("/"), role
        self.in_flight = 0
        self.problem: str | None = "not checked yet"  # why it is out (None: up)
        self.failures = 0  # failed requests in a row

    @property
    def up(self) -> bool:
        return self.problem is None

    def failed(self, why: str, eject: bool = False) -> None:
        self.failures += 1
        if eject or self.failures >= FAILURES_TO_EJECT:
            if self.up:
                logger.warning("the %s instance %s is out: %s", self.role, self.url, why)
            self.problem = why

    def succeeded(self) -> None:
        self.failures = 0


class _Pool:
    """The instances of one role; pick() the least loaded of those up, round-robin among equals."""

    def __init__(self, urls: list[str], role: str):
        self.instances = [_Instance(u, role) for u in urls]
        self._turn = itertools.count()

    def pick(self, exclude: _Instance | None = None) -> _Instance | None:
        live = [i for i in self.instances if i.up and i is not exclude]
        if not live:
            return None
        least = min(i.in_flight for i in live)
        candidates = [i for i in live if i.in_flight == least]
        return candidates[next(self._turn) % len(candidates)]


def _auth(request: Request) -> dict:
    """The client's Authorization header, passed on to the instances (their --api-key)."""
    return {k: v for k, v in request.headers.items() if k.lower() == "authorization"}


def _error(status: int, message: str, type_: str = "BadGatewayError", param: str | None = None) -> JSONResponse:
    return error_response(status, message, type_, param)


class _Failed(Exception):
    """A hop that did not answer: its instance was unreachable (refused: retry elsewhere), timed out
    or broke; the client gets `status` with the message."""

    def __init__(self, instance: _Instance, message: str, status: int = 502, refused: bool = False):
        super().__init__(f"the {instance.role} instance {instance.url} {message}")
        self.status, self.refused = status, refused


async def instance_info(session: aiohttp.ClientSession, url: str, secret: str) -> dict:
    """An instance's /kv_transfer/info once its /health is 200 (raises what went wrong)."""
    timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
    async with session.get(url + "/health", timeout=timeout) as r:
        if r.status != 200:
            raise RuntimeError(f"its /health is {r.status}")
    async with session.get(url + "/kv_transfer/info", headers={KV_SECRET_HEADER: secret}, timeout=timeout) as r:
        if r.status != 200:
            raise RuntimeError(f"its /kv_transfer/info is {r.status}: {(await r.text())[:200]}")
        return await r.json()


def _mismatch(instance: _Instance, info: dict, compat: dict | None) -> str | None:
    """Why this instance may not serve beside the others: its role, or its KV (None: it may)."""
    if info.get("role") != instance.role:
        return (
            f"is not a {instance.role} instance (it is started with --role {info.get('role')}; "
            f"give it to the router as --{info.get('role')} or start it with --role {instance.role})"
        )
    if compat is not None and info.get("kv_compat") != compat:
        theirs = info.get("kv_compat") or {}
        diff = ", ".join(f"{k} {theirs.get(k)!r}" for k in compat if theirs.get(k) != compat[k])
        return f"holds other KV than the other instances ({diff}; theirs: {compat}): another model, dtype or layout"
    return None


async def _check(
    session: aiohttp.ClientSession, i: _Instance, secret: str, compat: dict, announce: bool = True
) -> bool:
    """Check one instance: up (said in the log when it comes up, if announce), or out with why
    (i.problem); compat["kv"] is what the instances' KV is, the first one up's. Returns whether
    it answered."""
    try:
        info = await instance_info(session, i.url, secret)
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as e:
        i.failed(f"its health check failed: {type(e).__name__}: {e}", eject=True)
        return False
    problem = _mismatch(i, info, compat.get("kv"))
    if problem is not None:
        i.failed(problem, eject=True)
        return True
    compat.setdefault("kv", info.get("kv_compat"))
    if not i.up and announce:
        logger.info("the %s instance %s is up", i.role, i.url)
    i.problem, i.failures = None, 0
    return True


async def check_instances(prefill_urls: list[str], decode_urls: list[str], secret: str | None = None) -> list[str]:
    """The start-up check of `picovllm router`: the problems of the instances that answer (a wrong
    role, KV unlike the others'), in the order given; those that do not answer are not a problem
    yet (they join when their health check passes)."""
    secret, compat, problems = kv_transfer_secret(secret), {}, []
    instances = [_Instance(u, "prefill") for u in prefill_urls] + [_Instance(u, "decode") for u in decode_urls]
    async with aiohttp.ClientSession() as session:
        for i in instances:
            if await _check(session, i, secret, compat, announce=False) and not i.up:  # (the router says it)
                problems.append(f"the {i.role} instance {i.url} {i.problem}")
    return problems


class _Router:
    """The router's state (its pools, the HTTP session, its metrics, the secret it proves itself
    with) and what its routes do."""

    def __init__(
        self, prefill_urls, decode_urls, kv_secret, prefill_timeout_s, decode_timeout_s, health_check_interval_s
    ):
        self.secret = kv_transfer_secret(kv_secret)
        self.prefill, self.decode = _Pool(prefill_urls, "prefill"), _Pool(decode_urls, "decode")
        self.instances = self.prefill.instances + self.decode.instances
        self.prefill_timeout_s, self.decode_timeout_s = prefill_timeout_s, decode_timeout_s
        self.health_check_interval_s = health_check_interval_s
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("picovllm:router_requests", "requests by outcome", ["outcome"], registry=registry)
        self.prefill_s = Histogram(
            "picovllm:router_prefill_seconds",
            "time to the prefill instance's answer",
            registry=registry,
            buckets=_BUCKETS,
        )
        self.ttft = Histogram(
            "picovllm:router_time_to_first_byte_seconds", "time to the decode answer's first bytes", registry=registry
        )
        self.itl = Histogram(
            "picovllm:router_inter_chunk_seconds",
            "time between a streamed answer's chunks",
            registry=registry,
            buckets=_BUCKETS,
        )
        self.session: aiohttp.ClientSession | None = None
        self.compat: dict[str, dict] = {}  # "kv": what the instances' KV is (the first instance found up)
        self.background: set[asyncio.Task] = set()  # (lease releases under way)

    async def check_all(self) -> None:
        await asyncio.gather(*(_check(self.session, i, self.secret, self.compat) for i in self.instances))

    async def _health_checks(self) -> None:
        while True:
            await asyncio.sleep(self.health_check_interval_s)
            await self.check_all()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S))
        await self.check_all()
        checks = asyncio.create_task(self._health_checks())
        yield
        checks.cancel()
        await asyncio.gather(checks, *self.background, return_exceptions=True)
        await self.session.close()

    def release(self, instance: _Instance, kv: KVTransferParams, headers: dict) -> None:
        """End the prompt's lease on the prefill instance now (in the background)."""
        body = {"request_id": kv.remote_request_id}

        async def post() -> None:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
                async with self.session.post(
                    instance.url + "/kv_transfer/release", json=body, headers=headers, timeout=timeout
                ):
                    pass

        task = asyncio.create_task(post())
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def forward(self, path: str, body: dict, headers: dict):
        start = time.perf_counter()
        kv, holder = None, None
        if isinstance(body.get("prompt"), list) and body["prompt"] and not isinstance(body["prompt"][0], int):
            pass  # several prompts: the decode instance prefills them itself
        else:
            holder, kv, refusal = await _hop(
                self.prefill, lambda i: _prefill(self.session, i, path, body, headers, self.prefill_timeout_s)
            )
            if refusal is not None:
                self.requests.labels("refused").inc()
                return refusal
            self.prefill_s.observe(time.perf_counter() - start)
        timers = (start, self.ttft, self.itl, self.requests)
        try:
            _, response = await _hop(
                self.decode, lambda i: _decode(self.session, i, path, body, kv, headers, timers, self.decode_timeout_s)
            )
        except BaseException:  # (no answer from any decode instance, or the client gone)
            if kv is not None:
                self.release(holder, kv.params, headers)
            raise
        if kv is not None and isinstance(response, _Relay):
            response.on_incomplete = lambda: self.release(holder, kv.params, headers)
        elif kv is not None and response.status_code != 200:
            self.release(holder, kv.params, headers)  # (it refused the request: it will not pull)
        return response

    async def route(self, path: str, request: Request):
        requests = self.requests
        try:
            body = await request.json()
        except json.JSONDecodeError:
            requests.labels("bad_request").inc()
            return _error(400, "invalid JSON in the request body", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "BadRequestError")
        if "kv_transfer_params" in body:
            return _error(400, "kv_transfer_params are the router's to set", "BadRequestError", "kv_transfer_params")
        headers = {**_auth(request), KV_SECRET_HEADER: self.secret}
        try:
            return await cancel_on_disconnect(request, self.forward(path, body, headers))
        except _Failed as e:
            outcome, type_ = _FAILURES[e.status]
            requests.labels(outcome).inc()
            return _error(e.status, str(e), type_)
        except ClientGone:
            requests.labels("client_gone").inc()
            return Response(status_code=499)

    async def models(self, request: Request):
        instance = self.decode.pick() or self.decode.instances[0]
        try:
            async with self.session.get(instance.url + "/v1/models", headers=_auth(request)) as r:
                return Response(await r.read(), r.status, media_type=r.content_type)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return _error(502, str(_Failed(instance, f"is unreachable: {type(e).__name__}: {e}")))

    async def health(self):
        """200 while at least one instance of each role is up (checked now); 503 otherwise. The
        body names the instances that are out, and why."""
        await self.check_all()
        down = [i.url for i in self.instances if not i.up]
        why = {i.url: i.problem for i in self.instances if not i.up}
        serving = self.prefill.pick() is not None and self.decode.pick() is not None
        return JSONResponse({"down": down, "problems": why}, 200 if serving else 503)

    async def stats(self) -> dict:
        """Each instance's /stats (the dashboard; an instance that does not answer: its error)."""

        async def one(i: _Instance) -> dict:
            try:
                async with self.session.get(i.url + "/stats", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    return {"url": i.url, **(await r.json())}
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                return {"url": i.url, "error": str(_Failed(i, f"is unreachable: {type(e).__name__}: {e}"))}

        return {"instances": list(await asyncio.gather(*(one(i) for i in self.instances)))}


def build_router_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    web_ui: bool = True,
    kv_secret: str | None = None,
    prefill_timeout_s: float = 60.0,
    decode_timeout_s: float = 600.0,
    health_check_interval_s: float = 2.0,
) -> FastAPI:
    if not prefill_urls or not decode_urls:
        raise ValueError("the router needs at least one --prefill and one --decode instance")
    router = _Router(prefill_urls, decode_urls, kv_secret, prefill_timeout_s, decode_timeout_s, health_check_interval_s)
    app = FastAPI(title="Pico-vLLM router", lifespan=router.lifespan)
    app.add_exception_handler(StarletteHTTPException, http_error)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.route("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await router.route("/v1/chat/completions", request)

    app.get("/v1/models")(router.models)
    app.get("/health")(router.health)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    mount_web_ui(app, router.stats, web_ui)
    return app


# what the decode instance's answer alone needs (min_tokens would not even fit one token)
_NOT_FOR_PREFILL = (  # (its one token is not the answer's: the decode instance samples them all)
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "echo",
    "min_tokens",
    *STRUCTURED_FIELDS,
)
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_FAILURES = {  # a hop's status: (the outcome counted, the error's type)
    502: ("unreachable", "BadGatewayError"),
    503: ("no_instance", "ServiceUnavailableError"),
    504: ("timeout", "GatewayTimeoutError"),
}


async def _hop(pool: _Pool, call):
    """call(instance) on the least loaded instance of the pool that is up; once more on another if
    the first refused the connection. Returns (the instance, call's results...)."""
    first = pool.pick()
    if first is None:
        problems = "; ".join(f"{i.url}: {i.problem}" for i in pool.instances)
        raise _Failed(pool.instances[0], f"pool has no instance up ({problems})", 503)
    instance, last = first, None
    while instance is not None:
        try:
            result = await call(instance)
        except _Failed as e:
            instance.failed(str(e), eject=e.refused)
            if not e.refused or last is not None:
                raise
            last, instance = e, pool.pick(exclude=instance)
            continue
        instance.succeeded()
        return (instance, *result)
    raise last


def _hop_error(instance: _Instance, e: BaseException) -> _Failed:
    if isinstance(e, aiohttp.ClientConnectorError):
        return _Failed(instance, f"is unreachable: {type(e).__name__}: {e}", refused=True)
    return _Failed(instance, f"is unreachable: {type(e).__name__}: {e}")


async def _prefill(session, instance: _Instance, path: str, body: dict, headers: dict, timeout_s: float):
    """The prompt through a prefill instance: (its kv_transfer_params, None), or (None, the error
    response to pass back)."""
    first = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    first.update(max_tokens=1, n=1, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in first:
        first["max_completion_tokens"] = 1
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=CONNECT_TIMEOUT_S)
    instance.in_flight += 1
    try:
        async with session.post(instance.url + path, json=first, headers=headers, timeout=timeout) as r:
            answer = await r.read()
    except asyncio.TimeoutError:
        raise _Failed(instance, f"did not answer within {timeout_s:g} s (--prefill-timeout-s)", 504) from None
    except aiohttp.ClientError as e:
        raise _hop_error(instance, e) from None
    finally:
        instance.in_flight -= 1
    answered = time.perf_counter()
    if r.status >= 500:  # (the instance's engine failed: not the client's doing)
        raise _Failed(instance, f"failed: {answer.decode(errors='replace')[:500]}")
    if r.status != 200:  # (the client's request, refused: passed back as it came)
        return None, Response(answer, r.status, media_type=r.content_type)
    try:
        kv = KVTransferParams.from_dict(json.loads(answer).get("kv_transfer_params"))
    except (ValueError, AttributeError):
        kv = None
    if kv is None or not kv.pulls:
        raise _Failed(instance, "answered without kv_transfer_params: is it a prefill instance (--role prefill)?")
    return _LeaseClock(kv, answered), None


@dataclass(frozen=True)
class _LeaseClock:
    """A prefill instance's kv_transfer_params, whose remote_lease_s (the lease's time left) is
    counted down from when they arrived as they are sent on."""

    params: KVTransferParams
    arrived: float

    def now(self) -> dict:
        left = self.params.remote_lease_s - (time.perf_counter() - self.arrived)
        return replace(self.params, remote_lease_s=left).to_dict()


class _Relay(StreamingResponse):
    """The decode instance's answer, streamed back; on_incomplete runs if it ends before its end."""

    on_incomplete = None
    complete = False

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.complete and self.on_incomplete is not None:
                self.on_incomplete()


async def _decode(session, instance: _Instance, path: str, body: dict, kv, headers, timers, timeout_s: float):
    """The request through a decode instance, with the prefill instance's kv_transfer_params (a
    _LeaseClock; None: it prefills itself): (the response,), a relay of its answer as it comes when
    it streams, else the whole answer; timers: (the request's start, the first-byte and
    inter-chunk histograms, the outcome counter)."""
    start, ttft, itl, requests = timers
    if kv is not None:
        body = {**body, "kv_transfer_params": kv.now()}
    instance.in_flight += 1
    response, relayed = None, False
    try:
        response = await asyncio.wait_for(session.post(instance.url + path, json=body, headers=headers), timeout_s)
        first = await asyncio.wait_for(response.content.readany(), timeout_s - (time.perf_counter() - start))
        ttft.observe(time.perf_counter() - start)
        if body.get("stream") and response.status == 200:
            relayed = True
        else:
            rest = await asyncio.wait_for(response.read(), timeout_s)
            requests.labels("ok" if response.status == 200 else "error").inc()
            if response.status >= 500:
                raise _Failed(instance, f"failed: {(first + rest).decode(errors='replace')[:500]}")
            return (Response(first + rest, response.status, media_type=response.content_type),)
    except asyncio.TimeoutError:
        raise _Failed(instance, f"sent no answer within {timeout_s:g} s (--decode-timeout-s)", 504) from None
    except aiohttp.ClientError as e:
        raise _hop_error(instance, e) from None
    finally:
        if not relayed:  # (closed before its end: the decode instance sees the request go, and aborts)
            if response is not None:
                response.close()
            instance.in_flight -= 1

    async def relay():
        last = time.perf_counter()
        try:
            yield first
            async for chunk in response.content.iter_any():
                now = time.perf_counter()
                itl.observe(now - last)
                last = now
                yield chunk
            requests.labels("ok").inc()
            out.complete = True
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # the decode instance went away mid-answer
            requests.labels("broken").inc()
            instance.failed(f"broke off a stream: {type(e).__name__}: {e}")
            error = {"error": {"message": str(_hop_error(instance, e)), "type": "BadGatewayError", "code": 502}}
            yield f"data: {json.dumps(error)}\n\n".encode()
        finally:
            response.close()  # (before its end: the decode instance sees the client go, and aborts)
            instance.in_flight -= 1

    out = _Relay(relay(), response.status, media_type=response.content_type)
    return (out,)
