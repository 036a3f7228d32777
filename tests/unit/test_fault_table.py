"""The fault table (tests/support/fault_table.py): every row is triggered for real, in-process (real
files, a real copy of the tiny model, a real checkpoint, the start-up code that meets the fault),
and the lines distflow prints must be exactly the row's. The table in docs/troubleshooting.md is
generated from the same rows and must match them."""

from __future__ import annotations

import ast
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from config_helpers import fp32_config
from data_helpers import make_tokenizer
from distflow.checkpoint.checkpointer import POLICY, Checkpointer, ModelOptimState
from distflow.config import ConfigError, config_record
from distflow.errors import RunComplete
from docs_helpers import TROUBLESHOOTING, fault_table_markdown, generated_block
from fault_table import FAULTS, Fault, Scene, normalise, saved_config

TRIGGERED = [f for f in FAULTS if f.trigger is not None]


@pytest.fixture(scope="module")
def saved_checkpoint(tiny_model_dir, tmp_path_factory) -> Path:
    """A real checkpoint of step 1 (the tiny model and an AdamW), written once for the module."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ck = Checkpointer(tmp_path_factory.mktemp("faults") / "checkpoints", keep_last=1, rank=0)
    ck.register(POLICY, ModelOptimState(model, optimizer), "sharded")
    return ck.save(1, config_record(saved_config()), tiny_model_dir)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def scene(tmp_path, tiny_model_dir, tokenizer, saved_checkpoint) -> Scene:
    checkpoint = tmp_path / "run" / "checkpoints" / saved_checkpoint.name
    shutil.copytree(saved_checkpoint, checkpoint)
    return Scene(tmp_path, tiny_model_dir, tokenizer, checkpoint)


def printed(fault: Fault, scene: Scene, caplog) -> list[str]:
    """The console lines the fault produces: the warnings logged, then the stop's line, if any."""
    stop = []
    with caplog.at_level(logging.WARNING, logger="distflow"):
        try:
            fault.trigger(scene)
        except ConfigError as e:
            stop = [f"distflow: error: {e}"]
        except RunComplete as e:
            stop = [f"distflow: {e}"]
    warnings = [f"distflow: warning: {r.getMessage()}" for r in caplog.records
                if r.name.startswith("distflow") and r.levelno == logging.WARNING]
    return [normalise(line, scene) for line in warnings + stop]


def matches(expected: str, line: str) -> bool:
    pattern = ".+?".join(re.escape(part) for part in expected.split("<N>"))
    return re.fullmatch(pattern, line) is not None


@pytest.mark.parametrize("fault", TRIGGERED, ids=[f.id for f in TRIGGERED])
def test_each_fault_prints_exactly_its_lines(fault, scene, caplog):
    lines = printed(fault, scene, caplog)
    assert len(lines) == len(fault.prints) and all(map(matches, fault.prints, lines)), \
        f"{fault.id} printed:\n" + "\n".join(lines)


def test_the_docs_table_is_generated_from_the_rows():
    text = TROUBLESHOOTING.read_text(encoding="utf-8")
    assert generated_block(text, "fault-table") == fault_table_markdown(FAULTS), \
        "run: python tests/support/docs_helpers.py fault-table"


def test_rows_are_distinct_and_cover_every_area():
    assert len({f.id for f in FAULTS}) == len(FAULTS) >= 40
    assert len({f.prints for f in FAULTS}) == len(FAULTS)
    assert {f.area for f in FAULTS} >= {"config", "data", "model folder", "reward module", "tools", "checkpoints",
                                        "file system"}
    for f in FAULTS:
        assert f.prints and all(line.startswith("distflow: ") for line in f.prints), f.id


@pytest.mark.parametrize("fault", [f for f in FAULTS if f.trigger is None], ids=lambda f: f.id)
def test_a_row_checked_elsewhere_names_a_test_that_asserts_its_words(fault):
    """The named test exists and asserts the row's longest fixed piece of text (string literals joined
    as Python joins them), so neither can change without the other."""
    root = Path(__file__).resolve().parents[2]
    file, name = fault.tested_by.split("::")
    tree = ast.parse((root / file).read_text())
    test = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    assert test is not None, fault.tested_by
    texts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    piece = max((p.strip(" .,;:()") for p in fault.prints[0].removeprefix("distflow: error: ").split("<N>")), key=len)
    assert any(piece in text for text in texts), (fault.id, piece)

