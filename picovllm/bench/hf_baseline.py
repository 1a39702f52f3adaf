"""Hugging Face transformers on the same weights, dtype and device, for side-by-side figures.
mode 'eager': model.generate as shipped; 'compiled': static KV cache, with which generate compiles
the decode step itself (torch.compile, mode reduce-overhead: CUDA graphs; compiling the forward by
hand as well fails with transformers 5: CUDA-graph outputs overwritten)."""

from __future__ import annotations

import torch

from picovllm.config import resolve_device, resolve_dtype
from picovllm.model_source import resolve_model


class HFRunner:
    def __init__(self, llm_kwargs: dict, mode: str):
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg, path = resolve_model(llm_kwargs.get("model"))
        self.device = resolve_device(llm_kwargs.get("device", "auto"))
        dtype = resolve_dtype(llm_kwargs.get("dtype", "auto"), cfg.torch_dtype)
        if path is None:  # dummy:SHAPE, random weights of the real shape
            hf_cfg = AutoConfig.for_model(
                cfg.hf_config["architectures"][0].replace("ForCausalLM", "").lower(),
                **{k: v for k, v in cfg.hf_config.items() if k != "architectures"},
            )
            with torch.device(self.device):
                self.model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device)
        self.model.eval()
        self.vocab_size = cfg.vocab_size
        self.mode = mode
        if mode == "compiled":
            self.model.generation_config.cache_implementation = "static"
        elif mode != "eager":
            raise ValueError(f"unknown HF baseline mode {mode!r}; use eager or compiled")

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
        """Greedy; prompts of equal length, so no padding is involved."""
        input_ids = torch.tensor(prompts, device=self.device)
        return self.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
