"""CBraMod (ICLR 2025): criss-cross EEG foundation model; variants registered in :mod:`.variants`."""
from domainfm.models.cbramod.cbramod import CBraMod, ClassifierHead, CrissCrossLayer, PatchEmbedding, SelfAttention
from domainfm.models.cbramod.convert import convert_official_state_dict, to_official_state_dict
from domainfm.models.cbramod import variants  # noqa: F401  (registers the variants)

__all__ = [
    "CBraMod",
    "ClassifierHead",
    "CrissCrossLayer",
    "PatchEmbedding",
    "SelfAttention",
    "convert_official_state_dict",
    "to_official_state_dict",
    "OFFICIAL_SHA256",
    "OFFICIAL_URL",
]

from domainfm.models.cbramod.variants import OFFICIAL_SHA256, OFFICIAL_URL  # noqa: E402
