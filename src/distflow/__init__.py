"""distflow: distributed RL post-training for LLMs (see the README)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("distflow")
except PackageNotFoundError:  # run from a source tree on PYTHONPATH, not installed (the GPU check)
    __version__ = "0+source"
