"""The offline API, as in vLLM: LLM(...).generate(prompts, sampling_params) and .chat(...)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from picovllm.engine.input_processor import PromptType
from picovllm.engine.llm_engine import LLMEngine
from picovllm.logger import configure_default_logging
from picovllm.outputs import RequestOutput
from picovllm.sampling_params import RequestOutputKind, SamplingParams

Conversation = list[dict[str, str]]


class LLM:
    """An engine for offline batched generation.

    model: None (the default built-in model), a local Hugging Face directory, a .gguf file, a
    built-in name (see ``picovllm models``) or ``dummy:SHAPE`` (random weights). Other keyword
    arguments are EngineConfig's (block_size, max_num_seqs, max_model_len, gpu_memory_utilization,
    kv_cache_memory, ...); an unknown one raises ValueError.
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = "auto", seed: int = 0, **kwargs):
        configure_default_logging()  # (start-up lines at info, as vLLM's)
        self.llm_engine = LLMEngine.from_engine_args(model=model, dtype=dtype, device=device, seed=seed, **kwargs)
        self._request_counter = 0

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor_parallel_size > 1); also done by del and at exit."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Drop every cached KV block that no running request uses."""
        return self.llm_engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use when given no sampling_params: SamplingParams' defaults under
        those of the model's generation config (see EngineConfig.generation_config)."""
        return SamplingParams(**self.llm_engine.sampling_defaults)

    def get_metrics(self) -> dict[str, int]:
        """KV-cache and prefix-cache counters: kv_blocks_total, kv_blocks_free, kv_blocks_cached,
        prefix_cache_queried_tokens, prefix_cache_hit_tokens, num_running, num_waiting, ..."""
        return self.llm_engine.get_metrics()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns RequestOutputs in the order of the prompts.
        Every prompt is validated before any runs: bad input raises ValueError and runs nothing."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling_params given for {len(prompts)} prompts")
        engine = self.llm_engine
        checked = [engine.process_prompt(p, sp) for p, sp in zip(prompts, params)]
        # only finished outputs are used: the engine need not build the others every step
        params = [dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY) for sp in params]
        ids = []
        for (text, token_ids), sp in zip(checked, params):
            rid = f"offline-{self._request_counter}"
            self._request_counter += 1
            engine.add_validated_request(rid, text, token_ids, sp)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them (and tools, in
        OpenAI's format, for templates that take them) and generate. As vLLM's, the outputs are
        the model's text: a tool call is in it as the model writes it (the server parses it)."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer (the engine was started without one)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in conversations:
            # (an assistant's turn of tool calls may leave its content out, as OpenAI's clients do)
            if not conv or not all(
                isinstance(m, dict) and "role" in m and ("content" in m or m.get("tool_calls")) for m in conv
            ):
                raise ValueError("each message must be a dict with 'role' and 'content' (or 'tool_calls')")
            text = tokenizer.apply_chat_template(
                conv,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        # (no bar at all without use_tqdm: a disabled one still costs time on every call)
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True) if use_tqdm else None
        start, output_tokens = time.perf_counter(), 0
        try:
            while pending:
                if not engine.has_unfinished_requests():
                    raise RuntimeError(
                        f"requests {sorted(pending)} vanished from the engine (was it stepped from another thread?)"
                    )
                outputs = engine.step()
                if failed := engine.take_failed():  # (a step raised: the others are aborted below)
                    raise RuntimeError(f"request {failed[0][0]} failed: {failed[0][1]}")
                for out in outputs:
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        finished[out.request_id] = out
                        output_tokens += sum(len(o.token_ids) for o in out.outputs)
                        if bar is not None:
                            elapsed = time.perf_counter() - start
                            bar.set_postfix_str(f"{output_tokens / elapsed:.1f} output tok/s", refresh=False)
                            bar.update(1)
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[rid] for rid in request_ids]
