"""WBM: wearable behavioural foundation models (Mamba-2 / Transformer over hourly TST tokens).

Variants are registered in :mod:`.variants`; the chunked SSD scan and the Mamba-2 mixer live in
:mod:`.mamba2`; OpenMHC's released weights are converted (and its input contract stated) in
:mod:`.openmhc`.
"""
from domainfm.models.wearables.mamba2 import Mamba2, RMSNormGated, ssd_scan, ssd_sequential
from domainfm.models.wearables.wbm import (BACKBONES, WBM, BiMambaBlock, MambaBlock, MLPTokenizer, RotaryEmbedding,
                                          TransformerBlock, TSTTokenizer)
from domainfm.models.wearables import variants  # noqa: F401  (registers the variants)
from domainfm.models.wearables.variants import DEFAULT_VARIABLES
from domainfm.models.wearables.openmhc import convert_openmhc_state_dict, load_openmhc

__all__ = ["WBM", "TSTTokenizer", "MLPTokenizer", "MambaBlock", "BiMambaBlock", "TransformerBlock", "RotaryEmbedding",
           "Mamba2", "RMSNormGated", "ssd_scan", "ssd_sequential", "BACKBONES", "DEFAULT_VARIABLES",
           "convert_openmhc_state_dict", "load_openmhc"]
