"""GET /health, /metrics (Prometheus), /version and /v1/models."""

from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import picovllm
from picovllm.entrypoints.openai.serving import State

router = APIRouter()  # /health, /metrics and /version: no key, as vLLM's
v1_router = APIRouter()


@router.get("/health")
async def health(state: State):
    return Response(status_code=503 if state.engine.error else 200)


@router.get("/version")
async def version():
    return {"version": picovllm.__version__}


@router.get("/metrics")
async def metrics(state: State):
    return Response(generate_latest(state.metrics.exposition()), media_type=CONTENT_TYPE_LATEST)


@v1_router.get("/models")
async def models(state: State):
    return {
        "object": "list",
        "data": [
            {
                "id": state.served_model_name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "picovllm",
                "max_model_len": state.max_model_len,
            }
        ],
    }
