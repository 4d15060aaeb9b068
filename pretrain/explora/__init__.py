"""ExPLoRA extended pretraining (Khanna et al., ICML 2025, https://arxiv.org/abs/2406.10973).

A natural-image ViT continues its own self-supervised objective on a new domain while only
LoRA (rank 64, on q and v of every block but the last), the last block, every norm and the
class/register tokens train (``domainfm.lora`` preset ``"explora"``).

The two objectives live beside this entry point: :mod:`.dino` (``objective: dino``, DINOv2 with
iBOT and KoLeo, an EMA teacher) and :mod:`.mae` (``objective: mae``, masked-patch pixel
regression, also on the multispectral group-channel ViT). This module holds the config, the
backbone with its adapter, the data glue and :func:`run`.
"""
from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from domainfm import lora
from domainfm.engine import Recipe, TrainConfig, Trainer
from domainfm.experiment import ModelSection
from domainfm.pretrain.explora.dino import (
    DINOHead,
    DinoPretrainer,
    DinoRecipe,
    DinoSection,
    cosine_schedule,
    dino_loss,
    ibot_loss,
    koleo_loss,
    random_patch_masks,
    teacher_momentum,
    teacher_probs,
    teacher_temperature,
    update_center,
    vit_tokens,
)
from domainfm.pretrain.explora.mae import MaePretrainer, MaeRecipe, MaeSection

__all__ = [
    "Config",
    "run",
    "ModelSection",
    "AdapterSection",
    "DataSection",
    "build_backbone",
    "apply_adapter",
    "load_scene",
    "pretrain_dataset",
    # the objectives, re-exported (defined in .dino and .mae)
    "DinoSection",
    "MaeSection",
    "DINOHead",
    "DinoPretrainer",
    "MaePretrainer",
    "DinoRecipe",
    "MaeRecipe",
    "dino_loss",
    "ibot_loss",
    "koleo_loss",
    "teacher_probs",
    "update_center",
    "teacher_temperature",
    "teacher_momentum",
    "cosine_schedule",
    "random_patch_masks",
    "vit_tokens",
]


# ============================================================================ config


#: stochastic depth of extended pretraining unless model.kwargs sets drop_path_rate (the paper's ViT-L: 0.3)
DROP_PATH_RATE = 0.3


@dataclass
class AdapterSection:
    #: false: train every parameter (full extended pretraining, the comparison baseline)
    enabled: bool = True
    preset: str = "explora"
    rank: int = 64
    alpha: float = 1.0
    #: parameter globs made trainable on top of the preset's (e.g. ``patch_embed.*`` for new bands)
    extra_unfreeze: list[str] = field(default_factory=list)


@dataclass
class DataSection:
    #: ``sample`` (the shipped Sentinel-2 scene), ``raster`` (one file or ``paths``), ``folder``, ``csv``
    source: str = "sample"
    path: str | None = None
    paths: list[str] = field(default_factory=list)
    #: band names to read from rasters (``sample``/``raster``)
    bands: list[str] = field(default_factory=lambda: ["B04", "B03", "B02"])
    #: band indices for ``folder``/``csv`` images, and the band count they must have
    band_indices: list[int] | None = None
    n_bands: int | None = None
    tile_size: int = 12
    stride: int = 4
    #: per-band mean/std; null: computed from the scene (raster sources) — required for folder/csv
    mean: list[float] | None = None
    std: list[float] | None = None


@dataclass
class Config:
    objective: str = "dino"
    model: ModelSection = field(default_factory=lambda: ModelSection(name="explora-test"))
    adapter: AdapterSection = field(default_factory=AdapterSection)
    data: DataSection = field(default_factory=DataSection)
    dino: DinoSection = field(default_factory=DinoSection)
    mae: MaeSection = field(default_factory=MaeSection)
    train: TrainConfig = field(default_factory=TrainConfig)
    #: write the merged backbone (``backbone/``, our format; ``saved_model`` in the report) and the adapter (``adapter/``)
    export: bool = True
    #: also write the starting backbone (``init_backbone/``, ``saved_init``), for a like-for-like baseline
    export_init: bool = False

    def __post_init__(self):
        if self.objective not in {"dino", "mae"}:
            raise ValueError(f"objective={self.objective!r}: expected 'dino' or 'mae'")


# ============================================================================ entry


def build_backbone(section: ModelSection, *, extra_kwargs: dict | None = None) -> tuple[nn.Module, str]:
    """The backbone with the config's weights, through :func:`domainfm.experiment.resolve`
    (upstream files go through the card's converter; ``model.fallback: random`` only covers
    the card's own source being unreachable). Returns ``(model, init line)``, ``"random"`` when no
    weights were asked for."""
    from domainfm.experiment import resolve

    model, init = resolve(section.spec(section.pretrained, **(extra_kwargs or {})))
    return model, str(init) if section.pretrained else "random"


def apply_adapter(model: nn.Module, section: AdapterSection) -> nn.Module:
    from domainfm.models.explora.satmae import freeze_fixed_encodings

    if not section.enabled:
        model.requires_grad_(True)
        freeze_fixed_encodings(model)
        return model
    preset = lora.PRESETS[section.preset]
    values = dict(preset(model) if callable(preset) else preset)
    lora.apply(model, preset=section.preset, rank=section.rank, alpha=section.alpha,
               unfreeze=list(values["unfreeze"]) + list(section.extra_unfreeze))
    return model


def load_scene(data: DataSection):
    """The scene of a raster ``data`` section: ``domainfm.data_loaders.satellite.load_scene``
    (unpacks as normalised ``(C, H, W)`` image, raw array, band names, BandStats)."""
    from domainfm.data_loaders import satellite as S

    if data.source not in {"sample", "raster"}:
        raise ValueError(f"data.source={data.source!r} is not a raster source (sample or raster)")
    paths = data.paths or ([data.path] if data.path else [])
    if data.source == "raster" and not paths:
        raise ValueError("data.source=raster needs data.path or data.paths")
    try:
        return S.load_scene(data.source, paths=paths or None, bands=data.bands, mean=data.mean, std=data.std)
    except ValueError as exc:
        raise ValueError(f"data (source={data.source!r}, bands={data.bands}): {exc}") from None


def pretrain_dataset(data: DataSection, transform):
    """Unlabelled images for pretraining, each passed through ``transform``."""
    from domainfm.data_loaders import satellite as S

    if data.source in {"sample", "raster"}:
        return S.SceneTiles(load_scene(data).image, data.tile_size, data.stride, transform=transform)
    if data.mean is None or data.std is None:
        raise ValueError(f"data.source={data.source!r} needs data.mean and data.std (per-band statistics)")
    stats = S.BandStats(data.mean, data.std)
    if data.source == "folder":
        ds = S.ImageFolder(data.path, n_bands=data.n_bands, bands=data.band_indices, stats=stats)
    elif data.source == "csv":
        ds = S.CsvManifest(data.path, n_bands=data.n_bands, bands=data.band_indices, stats=stats)
    else:
        raise ValueError(f"data.source={data.source!r}: expected sample, raster, folder or csv")
    return S.UnlabelledImages(ds, transform)


def run(cfg: Config, run_dir: Path) -> dict:
    from domainfm import hub
    from domainfm.data_loaders import satellite as S

    run_dir = Path(run_dir)
    torch.manual_seed(cfg.train.seed)
    random.seed(cfg.train.seed)
    extra = {"n_outputs": 0, "drop_path_rate": cfg.model.kwargs.get("drop_path_rate", DROP_PATH_RATE)}
    if cfg.objective == "dino":
        extra["dynamic_img_size"] = True
    backbone, init = build_backbone(cfg.model, extra_kwargs=extra)
    total_params = sum(p.numel() for p in backbone.parameters())
    if cfg.export_init:
        hub.save_pretrained(backbone, run_dir / "init_backbone")
    apply_adapter(backbone, cfg.adapter)
    backbone_trainable = lora.count_trainable(backbone)

    if cfg.objective == "dino":
        d = cfg.dino
        transform = S.MultiCrop(d.global_size, d.local_size, d.n_local, tuple(d.global_scale), tuple(d.local_scale),
                                jitter=d.jitter)
        dataset = pretrain_dataset(cfg.data, transform)
        pretrainer = DinoPretrainer(backbone, d)
        grid = d.global_size // backbone.patch_embed.patch_size[0]
        recipe: Recipe = DinoRecipe(pretrainer, dataset, n_patches=grid * grid, seed=cfg.train.seed,
                                    base_weight_decay=cfg.train.weight_decay)
    else:
        m = cfg.mae
        dataset = pretrain_dataset(cfg.data, S.MaeTransform(m.img_size, tuple(m.crop_scale)))
        pretrainer = MaePretrainer(backbone, m)
        lora.apply(pretrainer.decoder, ["decoder_blocks.*.attn.qkv@q,v"], rank=m.decoder_lora_rank,
                   alpha=m.decoder_lora_alpha,
                   unfreeze=["decoder_embed.*", "decoder_norm.*", "decoder_blocks.*norm*", "decoder_pred.*",
                             "mask_token"])
        recipe = MaeRecipe(pretrainer, dataset)

    result = Trainer(cfg.train, run_dir=run_dir).fit(recipe)
    losses = [r["loss"] for r in result.history if r.get("split") == "train"]
    report: dict[str, Any] = {
        "objective": cfg.objective,
        "model": cfg.model.name,
        "init": init,
        "adapter": cfg.adapter.preset if cfg.adapter.enabled else "none (full training)",
        "params_total_backbone": total_params,
        "params_trainable_backbone": backbone_trainable,
        "params_trainable_all": lora.count_trainable(pretrainer),
        "steps": result.global_step,
        "first_loss": losses[0] if losses else float("nan"),
        "final_loss": losses[-1] if losses else float("nan"),
        "train_wall_s": round(result.wall_time_s, 2),
        "n_images": len(dataset),
    }
    if cfg.objective == "dino":
        report["final_teacher_temp"] = recipe.current_teacher_temp()
    if cfg.export:
        # DINOv2 evaluates the teacher; MAE has only the encoder. Export a merged *copy*: the
        # live teacher / encoder stay unmerged.
        source = pretrainer.teacher["backbone"] if cfg.objective == "dino" else pretrainer.encoder
        exported = copy.deepcopy(source)
        if cfg.adapter.enabled:
            lora.save_adapter(source, run_dir / "adapter", base_model_name=cfg.model.name)
            lora.merge(exported, unload=True)
        exported.domainfm_kwargs = {**exported.domainfm_kwargs, "drop_path_rate": 0.0}
        hub.save_pretrained(exported, run_dir / "backbone")
        report["saved_model"] = str(run_dir / "backbone")  # what a fine-tuning stage starts from
    if cfg.export_init:
        report["saved_init"] = str(run_dir / "init_backbone")  # the fine-tuning arm `stage_init`
    return report
