"""Weights hub: resolve, download, verify (sha256), cache, convert and load.

``create_model(name, pretrained=...)`` accepts

* ``True``: the first weight source of the variant's model card;
* ``"hf://org/repo"``: an upstream repository with ``config.json`` + ``model.safetensors``;
* ``"hf://org/repo/path/to/file"`` or ``"https://..."`` / ``"file://..."``: a URL. When the
  URL is one of the card's sources its recorded sha256 is verified; any other URL needs
  ``sha256=`` or is loaded with a warning that prints the digest it had;
* a local file (``.safetensors`` or a torch checkpoint, read with ``weights_only=True``);
* a directory written by :func:`save_pretrained`, or one laid out as an upstream repo
  (``model.safetensors`` / ``pytorch_model.bin`` beside a ``config.json``).

Which files are converted is decided by what the file is, never by how many keys happen to
match: our own format (a :func:`save_pretrained` folder, whose ``config.json`` has a
``domainfm`` block, or a safetensors file whose metadata names ``domainfm_model``) is loaded as
is; any other file is an upstream checkpoint and always goes through a converter (the
``converter=`` argument, else the weight source's recorded one, else the card's only one).
Every converter is idempotent, so a file that already holds our keys passes through unchanged.

Downloads go to a temporary file beside the destination, are hashed while streaming, and are
renamed into the cache (``$DOMAINFM_HOME/weights``, default ``~/.cache/domainfm/weights``) only
when the full sha256 matches, so the cache never holds a partial or unverified file. A file
downloaded without a pinned sha256 has its digest recorded in ``$DOMAINFM_HOME/weights.lock.json``
and verified on every later load (a file changed in the cache is refused). The cache key is the
whole URL (query string included; credentials and queries only as a digest in the path). With
``DOMAINFM_OFFLINE=1`` nothing is downloaded; a missing file is an error that names where to
put it. Nothing is ever unpickled with arbitrary code.

The package follows its seams: :mod:`.base` (errors, file names), :mod:`.cache` (cache folder,
lock file, digests), :mod:`.fetching` (downloads), :mod:`.checkpoints` (reading files safely),
:mod:`.loading` (keys, converters, ``load_pretrained``), :mod:`.save` (``save_pretrained``),
:mod:`.cards` (model cards) and :mod:`.create` (``create_model``).
"""
from __future__ import annotations

from domainfm.hub.base import (CONFIG_NAME, OWN_METADATA_KEY, WEIGHTS_NAME, ChecksumError, HubError, OfflineError,
                               UnsafeCheckpointError)
from domainfm.hub.cache import LOCK_FILE_NAME, cache_path_for, home, is_offline, sha256_file, weights_dir
from domainfm.hub.cards import model_card_text, write_model_card
from domainfm.hub.checkpoints import load_checkpoint
from domainfm.hub.create import create_model
from domainfm.hub.fetching import PACKAGE_SCHEME, fetch, package_path, parse_hf, resolve_timm
from domainfm.hub.loading import (LoadReport, download, fetch_hf_repo, is_own_file, load_pretrained,
                                  load_state_dict_into)
from domainfm.hub.save import save_pretrained

__all__ = [
    "HubError",
    "ChecksumError",
    "OfflineError",
    "UnsafeCheckpointError",
    "LoadReport",
    "home",
    "weights_dir",
    "is_offline",
    "cache_path_for",
    "fetch",
    "fetch_hf_repo",
    "sha256_file",
    "load_checkpoint",
    "load_state_dict_into",
    "load_pretrained",
    "is_own_file",
    "create_model",
    "save_pretrained",
    "write_model_card",
    "model_card_text",
    "download",
    "parse_hf",
    "resolve_timm",
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "OWN_METADATA_KEY",
    "LOCK_FILE_NAME",
    "PACKAGE_SCHEME",
    "package_path",
]
