"""A word-level tokenizer with a tiny chat template, and jsonl files: the data tests' fixtures."""

from __future__ import annotations

import json

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# Every whitespace-separated word is one token and each role marker is one special token, so a
# prompt of n words renders to exactly n + 2 ids ([user] ... [assistant]), n + 4 with a system prompt.
CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
WORDS = ["[unk]", "[system]", "[user]", "[assistant]", "what", "is", "one", "plus", "two", "be", "brief"]


def make_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[unk]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[unk]")
    hf.add_special_tokens({"additional_special_tokens": ["[system]", "[user]", "[assistant]"]})
    hf.chat_template = CHAT_TEMPLATE
    return hf


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)
