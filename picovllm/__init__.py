"""Pico-vLLM: a compact, readable and fast LLM inference engine."""

from picovllm.engine.llm_engine import LLMEngine
from picovllm.llm import LLM
from picovllm.outputs import CompletionOutput, Logprob, RequestOutput
from picovllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
]
__version__ = "0.1.0"
