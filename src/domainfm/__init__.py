"""domainfm: domain foundation models behind one zoo, one weights hub, one LoRA layer, one engine.

>>> import domainfm
>>> domainfm.list_models("cbramod*")                                    # doctest: +SKIP
>>> model = domainfm.create_model("cbramod-base", pretrained=True, n_outputs=4)  # doctest: +SKIP
"""
from domainfm.hub import create_model, load_pretrained, save_pretrained
from domainfm.zoo import ModelCard, WeightSource, list_families, list_models, model_info, register_model

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "create_model",
    "list_models",
    "list_families",
    "model_info",
    "register_model",
    "load_pretrained",
    "save_pretrained",
    "ModelCard",
    "WeightSource",
]
