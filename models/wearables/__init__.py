"""WBM: wearable behavioural foundation models (Mamba-2 / Transformer over hourly TST tokens).

Variants are registered in :mod:`.variants`; the chunked SSD scan and the Mamba-2 mixer live in
:mod:`.mamba2`.
"""
from domainfm.models.wearables.mamba2 import Mamba2, RMSNormGated, ssd_scan, ssd_sequential
from domainfm.models.wearables.wbm import BACKBONES, WBM, MambaBlock, RotaryEmbedding, TransformerBlock, TSTTokenizer
from domainfm.models.wearables import variants  # noqa: F401  (registers the variants)
from domainfm.models.wearables.variants import DEFAULT_VARIABLES

__all__ = ["WBM", "TSTTokenizer", "MambaBlock", "TransformerBlock", "RotaryEmbedding", "Mamba2", "RMSNormGated",
           "ssd_scan", "ssd_sequential", "BACKBONES", "DEFAULT_VARIABLES"]
