"""The hub's error types and file names."""
from __future__ import annotations

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
#: safetensors metadata key that marks a file written by domainfm (its value: the variant name)
OWN_METADATA_KEY = "domainfm_model"
_CHUNK = 1 << 20


class HubError(RuntimeError):
    """Base class of every weights-hub error."""


class ChecksumError(HubError):
    pass


class OfflineError(HubError):
    pass


class UnsafeCheckpointError(HubError):
    pass
