"""A model named by its Hugging Face id, as the commands that check and plan a topology see it: whether a name has
the form of an id (`org/name`), and the model's `config.json`, read from the Hugging Face cache or fetched into it
(one small file). huggingface_hub reads the environment: HF_HUB_OFFLINE=1 (the cache only), HF_TOKEN, HF_ENDPOINT,
HF_HOME / HF_HUB_CACHE. `marl serve` fetches the whole model by the same rules (servers/hub_models.py; marl/ does
not import servers/). Why a config cannot be read is said in one line (`HubConfigError`), chosen by the type of the
exception huggingface_hub raises.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from huggingface_hub import constants, errors, hf_hub_download, is_offline_mode

from marl.hub_ids import is_hub_id

__all__ = ["HubConfigError", "hub_config", "is_hub_id"]


class HubConfigError(ValueError):
    """The config.json of a model named by its Hugging Face id cannot be read: one line saying why."""


def hub_config(repo_id: str, revision: str | None = None, *, cache_only: bool = False) -> dict[str, Any]:
    """The model's config.json as a dict: from the Hugging Face cache, else (unless `cache_only`, or offline) fetched
    from the Hub into it. HubConfigError, in one line, when it cannot be had."""
    try:
        path = hf_hub_download(repo_id, "config.json", revision=revision, local_files_only=cache_only)
    except errors.LocalEntryNotFoundError:
        raise HubConfigError(f"{_named(repo_id, revision)} is not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
                             f" and {_unreachable(cache_only)}") from None
    except errors.GatedRepoError:  # before RepositoryNotFoundError, of which it is a kind
        raise HubConfigError(f"{_named(repo_id, revision)} is a gated model: accept its terms at {_page(repo_id)} and"
                             " set HF_TOKEN to a token of that account") from None
    except errors.RepositoryNotFoundError:
        raise HubConfigError(f"{_named(repo_id, revision)}: no such model repository on the Hub ({_page(repo_id)});"
                             " a private one needs HF_TOKEN") from None
    except errors.RevisionNotFoundError:
        raise HubConfigError(f"{repo_id} has no revision {revision!r} on the Hub ({_page(repo_id)})") from None
    except errors.RemoteEntryNotFoundError:
        raise HubConfigError(f"{_named(repo_id, revision)} has no config.json: it is no transformers model") from None
    except errors.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "no"
        raise HubConfigError(f"the Hub answered HTTP {status} for {_named(repo_id, revision)}") from None
    return json.loads(Path(path).read_text())


def _unreachable(cache_only: bool) -> str:
    if is_offline_mode():
        return "HF_HUB_OFFLINE=1 forbids fetching it"
    if cache_only:
        return "was not looked up on the Hub"
    return f"the Hub ({constants.ENDPOINT}) cannot be reached"


def _named(repo_id: str, revision: str | None) -> str:
    return f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")


def _page(repo_id: str) -> str:
    return f"{constants.ENDPOINT.rstrip('/')}/{repo_id}"
