"""The offline tiny model: builds, loads in transformers, deterministic, race-safe. (vLLM loads it and
matches transformers to 1e-5: distributed/test_weight_sync.py, before any perturbation.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distflow.models.tiny import MARKER, build_tiny_model, resolve_model_path

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 12 + 7?"},
    {"role": "assistant", "content": "12 + 7 = 19. The answer is 19."},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("cache")))


def _load(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tok, model


def test_builds_and_loads_in_transformers(model_dir):
    tok, model = _load(model_dir)
    cfg = model.config
    assert (Path(model_dir) / MARKER).is_file()
    assert Path(model_dir).name.startswith("tiny-qwen2-")
    assert cfg.architectures == ["Qwen2ForCausalLM"] and cfg.tie_word_embeddings
    assert cfg.hidden_size // cfg.num_attention_heads == 32
    assert 256 < len(tok) <= cfg.vocab_size and cfg.vocab_size % 64 == 0
    assert cfg.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert model.generation_config.eos_token_id == [tok.eos_token_id, tok.pad_token_id]

    text = "What is 12 + 7? The answer is 19."
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg.vocab_size) and torch.isfinite(logits).all()


def test_chat_template(model_dir):
    tok, _ = _load(model_dir)
    rendered = tok.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"
    )
    full = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert full.endswith("The answer is 19.<|im_end|>\n") and "assistant" not in full[-30:]
    ids = tok(full, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert ids.count(tok.eos_token_id) == 3
    assert tok.decode(ids) == full


def test_deterministic_across_cache_dirs(model_dir, tmp_path):
    other = build_tiny_model(str(tmp_path))
    assert Path(other).name == Path(model_dir).name
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (Path(other) / name).read_bytes() == (Path(model_dir) / name).read_bytes(), name


def test_half_written_folder_is_rebuilt(tmp_path):
    path = Path(build_tiny_model(str(tmp_path)))
    (path / MARKER).unlink()
    (path / "model.safetensors").write_bytes(b"garbage")
    assert build_tiny_model(str(tmp_path)) == str(path)
    assert (path / MARKER).is_file()
    assert (path / "model.safetensors").stat().st_size > 1000
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_concurrent_builds(model_dir, tmp_path):
    """Two processes race to build; both get the same finished folder, identical to ours."""
    code = "import sys; from distflow.models.tiny import build_tiny_model; print(build_tiny_model(sys.argv[1]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] and (Path(outs[0]) / MARKER).is_file()
    assert (Path(outs[0]) / "model.safetensors").read_bytes() == (Path(model_dir) / "model.safetensors").read_bytes()


def test_resolve_model_path(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTFLOW_CACHE", str(tmp_path))
    assert resolve_model_path("tiny").startswith(str(tmp_path))
    assert resolve_model_path("~/x") == os.path.expanduser("~/x")
    assert resolve_model_path("/abs/model") == "/abs/model"
