"""Hub names (`model.path=Qwen/Qwen3-0.6B`) resolved to a folder of the Hugging Face cache.

The trainer calls this on each node's local rank 0 first (distflow.distributed.on_local_rank0_first),
so one process per node downloads while the others wait, then finds the cached snapshot; with
HF_HUB_OFFLINE=1 nothing is downloaded and the cache alone answers. Only what a run reads is
fetched: config, tokenizer and safetensors weights, not a repository's other weight formats.
A missing, gated or uncached model is one line (ConfigError) on every rank, not a traceback.
"""

from __future__ import annotations

from distflow.config import ConfigError

# config and tokenizer files, safetensors weights and their index, remote code
FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]


def hub_snapshot(name: str) -> str:
    """The local folder of hub model `name` (owner/name), downloaded into the HF cache if needed."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"model.path {name!r}"
    try:
        return snapshot_download(repo_id=name, allow_patterns=FILES)
    except GatedRepoError:
        raise ConfigError(f"{where} is gated on the Hugging Face hub: accept its terms on the model's page, then "
                          "log in (`hf auth login`) or set HF_TOKEN") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise ConfigError(f"{where} is neither a local folder nor a model on the Hugging Face hub (or it is private: "
                          "log in or set HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        raise ConfigError(f"{where} is not in the Hugging Face cache and cannot be downloaded (offline, "
                          "HF_HUB_OFFLINE=1, or no network): download it first with `hf download "
                          f"{name}`, or point model.path at a local folder") from None
    except HfHubHTTPError as e:
        raise ConfigError(f"{where}: the Hugging Face hub answered {' '.join(str(e).split())[:200]}") from None
