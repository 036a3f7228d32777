import os
import sys

import pytest

# Nothing in the test suite may reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))  # shared helpers

# The environment every rank sets before its libraries start logging. Set once here, before any
# test runs, rather than by the first in-process Trainer: the gloo workers' fork server starts with
# the HF_* variables of that moment, and a later change makes every worker spawn (and import
# torch, transformers and vLLM) afresh (dist_helpers.READ_AT_IMPORT).
from distflow.run.hostmem import prefer_huge_pages  # noqa: E402
from distflow.run.output import quiet_third_party_env  # noqa: E402

quiet_third_party_env()
prefer_huge_pages()  # as recipes/grpo.py does, before torch loads (the workers inherit it)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The tiny offline model, built once per test session."""
    from distflow.models.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("models")))
