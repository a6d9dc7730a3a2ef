"""What a Hugging Face model id looks like, shared by the servers (which download the model: servers/hub_models.py)
and the commands that check and plan a topology (which read its config: marl/topology/hub_config.py). In the bottom
room: it imports nothing of the project."""

from __future__ import annotations

from huggingface_hub.utils import HFValidationError, validate_repo_id

__all__ = ["is_hub_id"]


def is_hub_id(text: str) -> bool:
    """Whether `text` has the form of a Hugging Face model id, `org/name` (huggingface_hub's rules for each part)."""
    if text.count("/") != 1:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True
