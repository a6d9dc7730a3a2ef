"""Models named by their Hugging Face id (`org/name`, at a revision: a branch, tag or commit; default main).

`hub_snapshot` finds the model in the Hugging Face cache or downloads it there (huggingface_hub's progress bars on
stderr), as vLLM and transformers do: the cache is `$HF_HUB_CACHE` (default `$HF_HOME/hub`, i.e.
`~/.cache/huggingface/hub`), so the engine, the trainer and any other tool on the machine share one copy.
huggingface_hub reads the rest of the environment itself: `HF_HUB_OFFLINE=1` (the cache only), `HF_TOKEN` (gated and
private models), `HF_ENDPOINT` (a mirror).

Only the files a checkpoint is loaded from are fetched: config, tokenizer, chat template and safetensors weights
(PyTorch `.bin` weights only where a repository has no safetensors; Llama's `original/` and Mistral's
`consolidated` copies never). What cannot be had is said in one line (`HubModelError`), chosen by the type of the
exception huggingface_hub raises: offline and not cached, gated, no such repository, no such revision.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from huggingface_hub import constants, errors, get_token, hf_hub_download, is_offline_mode, snapshot_download

from marl.hub_ids import is_hub_id

__all__ = ["HubModelError", "check_hub_model", "hub_cache", "hub_snapshot", "is_hub_id"]

#: What transformers and vLLM load a checkpoint from: config and tokenizer files (json, txt, sentencepiece, tiktoken),
#: the chat template and the safetensors weights.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
#: Second copies of the weights in another layout, which no loader here reads.
OTHER_LAYOUTS = ["original/*", "consolidated*"]
#: Weights as PyTorch pickles: fetched only for a repository without safetensors.
PICKLED_WEIGHTS = ["*.bin"]


class HubModelError(ValueError):
    """A model named by its Hugging Face id cannot be had: one line saying why and what to do."""


def hub_cache() -> str:
    """The Hugging Face cache this process uses (`HF_HUB_CACHE`, else `$HF_HOME/hub`)."""
    return constants.HF_HUB_CACHE


def check_hub_model(repo_id: str, revision: str | None = None) -> Path:
    """Fast, downloading one small file: the model's `config.json` (from the cache, or fetched into it); HubModelError
    unless the model can be had. What `marl serve` checks before it takes its port."""
    with hub_errors(repo_id, revision):
        return Path(hf_hub_download(repo_id, "config.json", revision=revision))


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The model's snapshot directory in the Hugging Face cache, downloading what is missing (with progress bars)."""
    with hub_errors(repo_id, revision):
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=MODEL_FILES,
                                        ignore_patterns=OTHER_LAYOUTS))
        if not any(folder.glob("*.safetensors")):  # an older checkpoint: its weights are pickles
            folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=PICKLED_WEIGHTS,
                                            ignore_patterns=OTHER_LAYOUTS))
    return folder


@contextmanager
def hub_errors(repo_id: str, revision: str | None) -> Iterator[None]:
    """huggingface_hub's exceptions as one `HubModelError` line each, by type (never by their text)."""
    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        yield
    except errors.LocalEntryNotFoundError as exc:
        raise HubModelError(f"cannot resolve model {where}: {_not_cached(repo_id, exc)}") from None
    except errors.GatedRepoError:  # before RepositoryNotFoundError, of which it is a kind
        raise HubModelError(f"cannot resolve model {where}: {_gated(repo_id)}") from None
    except errors.RepositoryNotFoundError:
        raise HubModelError(f"cannot resolve model {where}: no such model repository on the Hub ({_page(repo_id)}),"
                            " nor a directory of that name here; a private one needs HF_TOKEN") from None
    except errors.RevisionNotFoundError:
        raise HubModelError(f"cannot resolve model {where}: {repo_id} has no revision {revision!r} (a branch, tag or"
                            f" commit of {_page(repo_id)})") from None
    except errors.RemoteEntryNotFoundError:
        raise HubModelError(f"cannot resolve model {where}: it has no config.json, so it is no transformers model"
                            f" ({_page(repo_id)})") from None
    except errors.DisabledRepoError:
        raise HubModelError(f"cannot resolve model {where}: {_page(repo_id)} is disabled") from None
    except errors.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "no"
        raise HubModelError(f"cannot resolve model {where}: the Hub answered HTTP {status}; try again later") from None


def _not_cached(repo_id: str, exc: errors.LocalEntryNotFoundError) -> str:
    cache = hub_cache()
    if isinstance(exc, errors.IncompleteSnapshotError):
        return (f"its copy in the Hugging Face cache ({cache}) is incomplete and the Hub cannot be reached: run again"
                " where it can be, to complete it")
    if is_offline_mode():
        return (f"not in the Hugging Face cache ({cache}), and HF_HUB_OFFLINE=1 forbids downloading it: download it"
                f" once where the Hub can be reached (`hf download {repo_id}`), or unset HF_HUB_OFFLINE")
    return (f"not in the Hugging Face cache ({cache}), and the Hub ({constants.ENDPOINT}) cannot be reached: check"
            " the network, or set HF_ENDPOINT to a mirror")


def _gated(repo_id: str) -> str:
    if get_token() is None:
        return (f"a gated model: accept its terms at {_page(repo_id)} and set HF_TOKEN to a token of that account")
    return (f"a gated model, and the token given (HF_TOKEN, or `hf auth login`) has no access to it: accept its terms"
            f" at {_page(repo_id)} with that account")


def _page(repo_id: str) -> str:
    return f"{constants.ENDPOINT.rstrip('/')}/{repo_id}"
