"""Architecture name (config.json "architectures") -> model class."""

from torch import nn

from picovllm.model.qwen2 import Qwen2ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "LlamaForCausalLM": Qwen2ForCausalLM,  # same decoder: no QKV bias, its own rope settings
}
