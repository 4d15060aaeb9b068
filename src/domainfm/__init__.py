"""domainfm: domain foundation models behind one zoo, one weights hub, one LoRA layer, one engine.

>>> import domainfm
>>> domainfm.list_models("cbramod*")                                    # doctest: +SKIP
>>> model = domainfm.create_model("cbramod-base", pretrained=True, n_outputs=4)  # doctest: +SKIP
"""
from domainfm.hub import create_model, load_pretrained, save_pretrained
from domainfm.zoo import ModelCard, WeightSource, list_families, list_models, model_info, register_model

__version__ = "0.1.0"


def predict(model, inputs, **options):
    """Predictions of ``model`` (a fine-tuned model, its folder, a run folder or a name) for
    ``inputs`` (a file, or the family's Python object), one convention per output type: a
    ``pandas.DataFrame`` for tables, a dict of arrays, an ``AnnData`` or a raster. See
    :func:`domainfm.experiment.apply.predict`."""
    from domainfm.experiment import apply

    return apply.predict(model, inputs, **options)


def embed(model, inputs, **options):
    """Embeddings of ``inputs`` by ``model``; see :func:`domainfm.experiment.apply.embed`."""
    from domainfm.experiment import apply

    return apply.embed(model, inputs, **options)

__all__ = [
    "__version__",
    "create_model",
    "list_models",
    "list_families",
    "model_info",
    "register_model",
    "load_pretrained",
    "save_pretrained",
    "predict",
    "embed",
    "ModelCard",
    "WeightSource",
]
