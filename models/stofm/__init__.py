"""SToFM (ICML 2025): multi-scale spatial-transcriptomics foundation model; variants in :mod:`.variants`."""
from domainfm.models.stofm.cell_encoder import CLS_TOKEN_ID, GENEFORMER_VOCAB, CellEncoder
from domainfm.models.stofm.convert import (convert_official_cell_encoder, convert_official_state_dict,
                                           load_official, load_official_cell_encoder, to_official_state_dict)
from domainfm.models.stofm.stofm import (MASK_VALUE, TOKEN_CELL, TOKEN_CLS, TOKEN_HYPERNODE, TOKEN_PAD,
                                         DistanceBiasedAttention, GaussianDistanceBias, SToFM)
from domainfm.models.stofm import variants  # noqa: F401  (registers the variants)

__all__ = [
    "SToFM", "GaussianDistanceBias", "DistanceBiasedAttention", "CellEncoder",
    "TOKEN_CELL", "TOKEN_CLS", "TOKEN_HYPERNODE", "TOKEN_PAD", "MASK_VALUE", "CLS_TOKEN_ID", "GENEFORMER_VOCAB",
    "convert_official_state_dict", "to_official_state_dict", "convert_official_cell_encoder",
    "load_official", "load_official_cell_encoder",
]
