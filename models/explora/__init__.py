"""ExPLoRA: parameter-efficient extended pretraining of DINOv2 / MAE ViTs on satellite imagery.

Variants (all on timm's ViT, except the multispectral one on :class:`GroupChannelViT`):

* natural-image starting points: ``explora-dinov2-vit-{small,base,large}`` (DINOv2 /14 at 224),
  ``explora-mae-vit-{base,large}`` (MAE /16 at 224);
* ExPLoRA results: ``explora-vit-{base,large}-dinov2-fmow-rgb``,
  ``explora-vit-large-mae-fmow-sentinel`` (10 bands, 96 px, patch 8);
* test-sized: ``explora-test`` (RGB ViT) and ``explora-multispectral-test``.

Weight sources (``pretrained=True``): the natural-image starts through timm's own pretrained
configs (``timm://vit_large_patch14_dinov2.lvd142m`` etc.: timm names the Hub repository and
file), the ExPLoRA results from the Hub repository ``samarkhanna/ExPLoRA`` (the encoder-only
files; file names from the official README). No full sha256 or commit of these files could be
confirmed offline: each is verified against the sha256 the Hub publishes for it and the digest
seen on first download is recorded in ``$DOMAINFM_HOME/weights.lock.json`` and enforced after.
A downloaded official file also loads with ``create_model(name, pretrained="/path/file.pth")``
(or :func:`domainfm.models.explora.convert.load_official`, which also reads full ``teacher``
files).
"""
from __future__ import annotations

from domainfm.zoo import WeightSource, register_model

from .convert import convert_official, load_official
from .preset import explora_preset  # registers lora.PRESETS["explora"]
from .satmae import SENTINEL2_GROUPS, GroupChannelViT
from .vit import build_timm_vit, tiny_example_input, tiny_vit

__all__ = ["GroupChannelViT", "build_timm_vit", "convert_official", "load_official", "SENTINEL2_GROUPS"]

PAPER = "https://arxiv.org/abs/2406.10973"
HF_REPO = "hf://samarkhanna/ExPLoRA"
_CONVERTERS = {"official": convert_official}
_RGB = {"n_chans": 3, "bands": ["red", "green", "blue"]}
_S2_BANDS = ["B2", "B3", "B4", "B5", "B6", "B7", "B8", "B8A", "B11", "B12"]


def _rgb_card(img_size: int, patch: int) -> dict:
    return {**_RGB, "img_size": img_size, "patch_size": patch}


_UNPINNED = "no pinned sha256/revision confirmed offline: the Hub's published digest + the lock file"
#: the official ExPLoRA files carry no licence statement we could confirm offline
_EXPLORA_LICENSE = "unknown"
#: timm's pretrained tag of each natural-image start
_TIMM_TAGS = {"dinov2-small": "vit_small_patch14_dinov2.lvd142m", "dinov2-base": "vit_base_patch14_dinov2.lvd142m",
              "dinov2-large": "vit_large_patch14_dinov2.lvd142m", "mae-base": "vit_base_patch16_224.mae",
              "mae-large": "vit_large_patch16_224.mae"}


#: what each natural-image start saw (DINOv2 paper, sec. 3 and its data-sources table; MAE paper):
#: (pretraining data, public benchmarks it contains, what could not be confirmed)
_LVD142M = ("LVD-142M (DINOv2, unlabelled): curated ImageNet-22k, ImageNet-1k train split, Google Landmarks and "
            "the train splits of several fine-grained sets, plus web images retrieved near them and deduplicated "
            "against the evaluation benchmarks' test/validation sets")
_LVD142M_OVERLAPS = ("ImageNet-1k", "ImageNet-22k", "Google Landmarks v2")
_IMAGENET = "ImageNet-1k train split, unlabelled (MAE self-supervised pretraining)"
_START_DATA = {"dinov2": (_LVD142M, _LVD142M_OVERLAPS,
                          "train splits only; the fine-grained sets in LVD-142M are not listed here"),
               "mae": (_IMAGENET, ("ImageNet-1k",), "")}


def _timm_source(arch: str, license: str) -> WeightSource:
    # the converter resamples DINOv2's 518-px position table to the card's 224 px (timm keys otherwise)
    data, overlaps, note = _START_DATA[arch.split("-")[0]]
    return WeightSource(f"timm://{_TIMM_TAGS[arch]}", converter="official", license=license,
                        description=f"timm's {_TIMM_TAGS[arch]} weights (location from timm's pretrained config)",
                        note="; ".join(n for n in (_UNPINNED, note) if n), pretraining_data=data, overlaps=overlaps)


def _official_source(path: str, description: str, *, start: str, satellite: str, data_note: str) -> WeightSource:
    """An ExPLoRA result: its natural-image start's data, then unlabelled extended pretraining on ``satellite``."""
    data, overlaps, _ = _START_DATA[start]
    return WeightSource(f"{HF_REPO}/{path}", converter="official", license=_EXPLORA_LICENSE,
                        description=description, state_dict_key=None, note=f"{_UNPINNED}; {data_note}",
                        pretraining_data=f"{data}; then ExPLoRA's extended pretraining on {satellite} images, "
                                         "unlabelled",
                        overlaps=(satellite, *overlaps))


def _register_timm(name: str, arch: str, *, img_size: int, patch: int, description: str, license: str,
                   weights=()) -> None:
    def builder(**kwargs):
        return build_timm_vit(arch, **kwargs)

    builder.__doc__ = description
    register_model(
        name, family="explora", paper=PAPER, license=license, description=description,
        input_spec=_rgb_card(img_size, patch), defaults={"img_size": img_size, "n_outputs": 0},
        converters=_CONVERTERS, head="head", weights=list(weights),
    )(builder)


for _size in ("small", "base", "large"):
    _register_timm(
        f"explora-dinov2-vit-{_size}", f"dinov2-{_size}", img_size=224, patch=14, license="Apache-2.0",
        description=f"DINOv2 ViT-{_size[0].upper()}/14 at 224 px (timm vit_{_size}_patch14_dinov2): ExPLoRA's natural-image start",
        weights=[_timm_source(f"dinov2-{_size}", "Apache-2.0")],
    )
for _size in ("base", "large"):
    _register_timm(
        f"explora-mae-vit-{_size}", f"mae-{_size}", img_size=224, patch=16, license="CC-BY-NC-4.0",
        description=f"MAE ViT-{_size[0].upper()}/16 at 224 px (timm vit_{_size}_patch16_224.mae layout): ExPLoRA's MAE start",
        weights=[_timm_source(f"mae-{_size}", "CC-BY-NC-4.0")],
    )
for _size in ("base", "large"):
    _register_timm(
        f"explora-vit-{_size}-dinov2-fmow-rgb", f"dinov2-{_size}", img_size=224, patch=14, license="unknown",
        description=(
            f"ExPLoRA DINOv2 ViT-{_size[0].upper()}/14 extended-pretrained on fMoW-RGB (official file "
            f"{HF_REPO[5:]}/explora_dinov2_fmow_rgb/explora_dinov2_vit_{_size}_fmow_rgb_encoder_only.pth)"
        ),
        weights=[_official_source(
            f"explora_dinov2_fmow_rgb/explora_dinov2_vit_{_size}_fmow_rgb_encoder_only.pth",
            f"ExPLoRA DINOv2 ViT-{_size[0].upper()}/14 on fMoW-RGB, encoder only (LoRA merged)",
            start="dinov2", satellite="fMoW-RGB", data_note="not confirmed: which fMoW-RGB splits were seen")],
    )


@register_model(
    "explora-vit-large-mae-fmow-sentinel", family="explora", paper=PAPER, license="unknown",
    description=(
        "ExPLoRA MAE ViT-L/8 group-channel (SatMAE) on fMoW-Sentinel, 10 bands, 96 px (official file "
        "samarkhanna/ExPLoRA/explora_mae_multispectral/explora_mae_fmow_sentinel_encoder_only.pth)"
    ),
    input_spec={"n_chans": 10, "bands": _S2_BANDS, "img_size": 96, "patch_size": 8,
                "channel_groups": [list(g) for g in SENTINEL2_GROUPS]},
    defaults={"n_outputs": 0}, converters=_CONVERTERS, head="head",
    weights=[_official_source("explora_mae_multispectral/explora_mae_fmow_sentinel_encoder_only.pth",
                              "ExPLoRA MAE ViT-L group-channel on fMoW-Sentinel (10 bands), encoder only (LoRA merged)",
                              start="mae", satellite="fMoW-Sentinel",
                              data_note="not confirmed: which fMoW-Sentinel splits were seen, and that the start "
                                        "was MAE's ImageNet-1k checkpoint (inferred from the file name)")],
)
def explora_vit_large_mae_fmow_sentinel(**kwargs):
    """ExPLoRA multispectral ViT-L (SatMAE group channels)."""
    return GroupChannelViT(**kwargs)


@register_model(
    "explora-test", family="explora", paper=PAPER, license="Apache-2.0",
    description="test-sized timm ViT (DINOv2 layout: LayerScale, class token), 32 px, patch 4",
    input_spec=_rgb_card(32, 4), defaults={"n_outputs": 10}, converters=_CONVERTERS, head="head",
    tags=("test",), example_input=lambda: tiny_example_input(3, 32),
)
def explora_test(**kwargs):
    """Test-sized ExPLoRA ViT."""
    return tiny_vit(**kwargs)


@register_model(
    "explora-multispectral-test", family="explora", paper=PAPER, license="Apache-2.0",
    description="test-sized group-channel ViT: 10 bands, 3 groups, 16 px, patch 4",
    input_spec={"n_chans": 10, "bands": _S2_BANDS, "img_size": 16, "patch_size": 4},
    defaults={"n_outputs": 5, "img_size": 16, "patch_size": 4, "in_chans": 10, "embed_dim": 48, "depth": 3,
              "num_heads": 3, "channel_embed": 16},
    converters=_CONVERTERS, head="head", tags=("test",), example_input=lambda: tiny_example_input(10, 16),
)
def explora_multispectral_test(**kwargs):
    """Test-sized group-channel ViT."""
    return GroupChannelViT(**kwargs)
