"""ExPLoRA fine-tuning: image classification with LoRA / full / linear probe, top-1 and top-5.

The paper's fine-tuning (fMoW-RGB): LoRA rank 8 on every block (q, v of the fused qkv here),
the head and ``fc_norm`` trained in full, global average pooling + ``fc_norm``, 120 epochs,
base lr 1e-3, weight decay 0, drop path 0.2, label smoothing 0.1, RandAugment m9 (not
reproduced: RandAugment is RGB-only; flips are used). Linear probing trains only the head on
frozen features. ``configs/explora/finetune_fmow_rgb.yaml`` holds these settings.

The embedded default (``domainfm finetune explora``, ``configs/explora/finetune.yaml``) runs
offline in a few minutes on the shipped Sentinel-2 scene: a short ExPLoRA extended pretraining of
a test-sized ViT on RGB tiles (from random init: no DINOv2 weights offline, said in the report as
``init``), then LoRA fine-tuning on a 4-class tile task whose labels are **derived from spectral
indices** (NDWI water fraction, mean NDVI; ``data_loaders.satellite.spectral_index_classes``),
next to the *same* starting weights fine-tuned without extended pretraining.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from domainfm import lora
from domainfm.engine import TrainConfig, Trainer
from domainfm.finetune import metrics as M
from domainfm.finetune.supervised import LoraSettings, SupervisedRecipe, prepare_mode

__all__ = ["Config", "run", "evaluate", "ClassificationRecipe", "load_backbone_weights"]

LABELS_NOTE = (
    "constructed labels: each 12x12-px (720 m) tile of the shipped Sentinel-2 scene is labelled from spectral "
    "indices of its own pixels (water: >=50% pixels NDWI>0; shore_mixed: >=10%; else moderate/dense vegetation by "
    "mean NDVI < / >= 0.45). The model sees only RGB (B04,B03,B02). Not ground truth."
)


@dataclass
class ModelSection:
    name: str = "explora-test"
    kwargs: dict = field(default_factory=dict)
    #: a ``backbone/`` dir from ``domainfm pretrain explora``, an official ``.pth``, ``true`` or null
    pretrained: str | None = None
    pretrained_fallback: str = "error"
    global_pool: str = "avg"
    drop_path_rate: float = 0.2


@dataclass
class DataSection:
    #: ``sample`` (shipped scene + spectral-index labels), ``folder`` (root/<class>/*.tif) or ``csv``
    source: str = "sample"
    path: str | None = None
    val_path: str | None = None
    bands: list[str] = field(default_factory=lambda: ["B04", "B03", "B02"])
    band_indices: list[int] | None = None
    n_bands: int | None = None
    tile_size: int = 12
    img_size: int = 32
    mean: list[float] | None = None
    std: list[float] | None = None
    #: sample: tiles in blocks of ``split_block`` x ``split_block`` tiles, every ``split_every``-th diagonal block validates
    split_block: int = 4
    split_every: int = 4
    #: folder/csv without val_path: fraction held out (seeded)
    val_fraction: float = 0.2


@dataclass
class ExtendedPretrainingSection:
    """Run ``domainfm pretrain explora`` first (the embedded demo) and fine-tune its backbone."""

    enabled: bool = False
    #: shipped config name (``pretrain``) or a YAML path
    config: str = "pretrain"
    overrides: list[str] = field(default_factory=list)
    #: also fine-tune the very same starting weights without extended pretraining
    compare_without: bool = True


@dataclass
class Config:
    mode: str = "lora"
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    lora: LoraSettings = field(default_factory=lambda: LoraSettings(
        targets=["blocks.*.attn.qkv@q,v"], rank=8, alpha=8.0, unfreeze=["fc_norm.*"]))
    label_smoothing: float = 0.1
    train: TrainConfig = field(default_factory=TrainConfig)
    extended_pretraining: ExtendedPretrainingSection = field(default_factory=ExtendedPretrainingSection)

    def __post_init__(self):
        if self.mode not in {"lora", "full", "linear_probe"}:
            raise ValueError(f"mode={self.mode!r}: expected 'lora', 'full' or 'linear_probe'")
        if self.model.pretrained_fallback not in {"error", "random"}:
            raise ValueError(f"model.pretrained_fallback={self.model.pretrained_fallback!r}: expected 'error' or 'random'")


class ClassificationRecipe(SupervisedRecipe):
    """Multiclass classification reporting top-1 and top-5 beside the shared metric set."""

    def metrics(self, outputs):
        result = super().metrics(outputs)
        scores, target = outputs["scores"], outputs["target"]
        result["top1"] = result["accuracy"]
        if scores.shape[1] > 5:  # with <= 5 classes top-5 is always 1
            result["top5"] = M.top_k_accuracy(target, scores, k=5)
        return result


# ----------------------------------------------------------------------------- data


def _sample_datasets(data: DataSection, train_tf, eval_tf):
    from domainfm.data_loaders import satellite as S
    from domainfm.pretrain.explora import DataSection as PData
    from domainfm.pretrain.explora import load_scene

    raw_all = S.read_raster(S.sample_scene_path())  # every band: the labels need B03/B04/B08
    scene, _, _, stats = load_scene(PData(source="sample", bands=data.bands, mean=data.mean, std=data.std))
    raw = torch.from_numpy(raw_all.data.astype(np.float32))
    ts, blk, every = data.tile_size, data.split_block, data.split_every

    def is_val(r: int, c: int) -> bool:
        return ((r // ts) // blk + (c // ts) // blk) % every == 0

    def label(tile):
        return S.spectral_index_classes(tile, raw_all.band_names)

    train = S.SceneTiles(scene, ts, transform=train_tf, labels_fn=label, keep=lambda r, c: not is_val(r, c), raw=raw)
    val = S.SceneTiles(scene, ts, transform=eval_tf, labels_fn=label, keep=is_val, raw=raw)
    return train, val, list(S.INDEX_CLASSES), stats


def _file_datasets(data: DataSection, train_tf, eval_tf, seed: int):
    from domainfm.data_loaders import satellite as S

    if data.mean is None or data.std is None:
        raise ValueError(f"data.source={data.source!r} needs data.mean and data.std (per-band statistics)")
    stats = S.BandStats(data.mean, data.std)
    kw = dict(n_bands=data.n_bands, bands=data.band_indices, stats=stats)
    make = S.ImageFolder if data.source == "folder" else S.CsvManifest
    if data.source not in {"folder", "csv"}:
        raise ValueError(f"data.source={data.source!r}: expected sample, folder or csv")
    if data.path is None:
        raise ValueError(f"data.source={data.source!r} needs data.path")
    full = make(data.path, **kw)
    classes = list(full.classes) if full.classes is not None else None
    if data.val_path:
        val_ds = make(data.val_path, **kw) if data.source == "folder" else make(data.val_path, classes=classes, **kw)
        train_idx, val_idx = list(range(len(full))), None
    else:
        order = torch.randperm(len(full), generator=torch.Generator().manual_seed(seed)).tolist()
        n_val = max(1, int(round(data.val_fraction * len(full))))
        train_idx, val_idx, val_ds = order[n_val:], order[:n_val], full
    train = _Mapped(full, train_idx, train_tf)
    val = _Mapped(val_ds, val_idx, eval_tf)
    if classes is None:
        classes = [str(i) for i in range(int(max(lbl for _, lbl in full.samples)) + 1)]
    return train, val, classes, stats


class _Mapped(torch.utils.data.Dataset):
    def __init__(self, ds, indices, transform):
        self.ds, self.indices, self.transform = ds, indices, transform

    def __len__(self):
        return len(self.indices) if self.indices is not None else len(self.ds)

    def __getitem__(self, i):
        x, y = self.ds[self.indices[i] if self.indices is not None else i]
        return self.transform(x), y


def build_datasets(cfg: Config):
    from domainfm.data_loaders import satellite as S

    train_tf = S.Resize(cfg.data.img_size, flip=True)
    eval_tf = S.Resize(cfg.data.img_size)
    if cfg.data.source == "sample":
        return _sample_datasets(cfg.data, train_tf, eval_tf)
    return _file_datasets(cfg.data, train_tf, eval_tf, cfg.train.seed)


# ----------------------------------------------------------------------------- model


def load_backbone_weights(model: nn.Module, source: str) -> str:
    """Load a pretrain run's ``backbone/`` dir (our format) or an official ExPLoRA ``.pth`` into
    ``model`` (built with the fine-tune head), via the official converter (``norm`` -> ``fc_norm``
    for average pooling, resampled position table); the head keeps its fresh init."""
    from domainfm import hub
    from domainfm.models.explora.convert import convert_official, load_official

    path = Path(source)
    if path.is_dir():
        weights = path / hub.WEIGHTS_NAME
        if not weights.is_file():
            raise FileNotFoundError(f"{path} has no {hub.WEIGHTS_NAME}; expected a `backbone/` dir of a pretrain run")
        sd = convert_official(hub.load_checkpoint(weights), model)
        sd = {k: v for k, v in sd.items() if not k.startswith("head.")}
        hub.load_state_dict_into(model, sd, heads=("head",), source=str(path))
    else:
        load_official(model, path)
    return f"pretrained: {source}"


def build_model(cfg: Config, n_classes: int, weights: str | None):
    from domainfm import create_model
    from domainfm.hub import HubError

    kwargs = {**cfg.model.kwargs, "n_outputs": n_classes, "global_pool": cfg.model.global_pool,
              "drop_path_rate": cfg.model.drop_path_rate}
    model = create_model(cfg.model.name, **kwargs)
    if weights is None or weights == "random":
        return model, "random"
    try:
        if weights in {"true", "True"}:
            from domainfm.hub import load_pretrained

            load_pretrained(model, True)
            return model, f"pretrained: {cfg.model.name}"
        return model, load_backbone_weights(model, weights)
    except (HubError, FileNotFoundError) as exc:
        if cfg.model.pretrained_fallback != "random":
            raise HubError(
                f"cannot load weights {weights!r} for {cfg.model.name} ({exc}). Pass model.pretrained=/path "
                "(a pretrain run's backbone/ dir or an official ExPLoRA .pth), or set "
                "model.pretrained_fallback=random to continue from random init."
            ) from exc
        print(f"[explora] {exc}\n[explora] model.pretrained_fallback=random: continuing from RANDOM initialisation.")
        return create_model(cfg.model.name, **kwargs), "random"


def _prepare(model: nn.Module, cfg: Config) -> nn.Module:
    prepare_mode(model, cfg.mode, head="head", lora=cfg.lora)
    from domainfm.pretrain.explora import _refreeze_fixed

    _refreeze_fixed(model)
    return model


def _fit_arm(cfg: Config, model: nn.Module, train, val, run_dir: Path) -> dict[str, Any]:
    total = sum(p.numel() for p in model.parameters())
    _prepare(model, cfg)
    trainable = lora.count_trainable(model)
    train_cfg = copy.deepcopy(cfg.train)
    if train_cfg.monitor is None:
        train_cfg.monitor, train_cfg.monitor_mode = "val/top1", "max"
    recipe = ClassificationRecipe(model, train, val, task="multiclass", label_smoothing=cfg.label_smoothing)
    result = Trainer(train_cfg, run_dir=run_dir).fit(recipe)
    best = [r for r in result.history if r.get("split") == "val" and r.get("step") == result.best_step]
    metrics = {k: v for k, v in (best[-1] if best else result.last_val).items() if k not in {"split", "step", "epoch"}}
    return {"metrics": metrics, "params_total": total, "params_trainable": trainable, "best_step": result.best_step,
            "last_val": result.last_val}


def _majority_accuracy(train, val) -> float:
    counts = np.bincount(np.asarray([int(y) for y in _labels(train)]))
    majority = int(counts.argmax())
    ys = np.asarray([int(y) for y in _labels(val)])
    return float((ys == majority).mean())


def _labels(ds):
    if getattr(ds, "labels", None) is not None:
        return ds.labels.tolist()
    return [ds[i][1] for i in range(len(ds))]


def run(cfg: Config, run_dir: Path) -> dict:
    run_dir = Path(run_dir)
    torch.manual_seed(cfg.train.seed)
    train, val, classes, _ = build_datasets(cfg)
    report: dict[str, Any] = {"mode": cfg.mode, "model": cfg.model.name, "n_classes": len(classes),
                              "n_train": len(train), "n_val": len(val)}
    if cfg.data.source == "sample":
        report["labels"] = LABELS_NOTE
        report["majority_class_top1"] = _majority_accuracy(train, val)

    weights, baseline_weights = cfg.model.pretrained, None
    init_note = None
    if cfg.extended_pretraining.enabled:
        from domainfm import config as cfgmod
        from domainfm.pretrain import explora as P

        ep = cfg.extended_pretraining
        path = Path(ep.config) if Path(ep.config).suffix in {".yaml", ".yml"} else cfgmod.config_path("explora", ep.config)
        raw = cfgmod.apply_overrides(cfgmod.load_yaml(path), list(ep.overrides))
        pcfg = cfgmod.from_dict(P.Config, raw)
        pcfg.export, pcfg.export_init = True, ep.compare_without
        if pcfg.model.name != cfg.model.name:
            raise ValueError(f"extended pretraining trains {pcfg.model.name!r} but model.name is {cfg.model.name!r}")
        print(f"[explora] extended pretraining ({pcfg.objective}, {pcfg.train.max_steps or pcfg.train.max_epochs} "
              f"{'steps' if pcfg.train.max_steps else 'epochs'}) -> {run_dir / 'extended_pretraining'}")
        pre = P.run(pcfg, run_dir / "extended_pretraining")
        cfgmod.save_yaml(pcfg, run_dir / "extended_pretraining" / "config.yaml")
        weights = pre["backbone_dir"]
        init_note = f"{pre['init']} + ExPLoRA extended pretraining ({pre['steps']} steps)"
        if pre["init"] == "random":
            print("[explora] NOTE: no DINOv2 weights offline: the extended pretraining started from RANDOM init.")
        report.update({"pretrain_init": pre["init"], "pretrain_steps": pre["steps"],
                       "pretrain_first_loss": pre["first_loss"], "pretrain_final_loss": pre["final_loss"],
                       "pretrain_trainable_params": pre["params_trainable_backbone"]})
        if ep.compare_without:
            baseline_weights = str(run_dir / "extended_pretraining" / "init_backbone")

    model, init = build_model(cfg, len(classes), weights)
    report["init"] = init_note or init
    main_arm = _fit_arm(cfg, model, train, val, run_dir)
    report.update({"params_total": main_arm["params_total"], "params_trainable": main_arm["params_trainable"],
                   "best_step": main_arm["best_step"]})
    for key in ("top1", "top5", "balanced_accuracy", "cohen_kappa", "f1_weighted", "loss"):
        if key in main_arm["metrics"]:
            report[key] = main_arm["metrics"][key]
    if baseline_weights is not None:
        base_model, base_init = build_model(cfg, len(classes), baseline_weights)
        base = _fit_arm(cfg, base_model, train, val, run_dir / "without_extended_pretraining")
        report["baseline_init"] = f"{pre['init']} (same starting weights, no extended pretraining)"
        for key in ("top1", "top5", "balanced_accuracy", "cohen_kappa"):
            if key in base["metrics"]:
                report[f"baseline_{key}"] = base["metrics"][key]
        report["top1_gain_from_extended_pretraining"] = report.get("top1", float("nan")) - report.get("baseline_top1", float("nan"))
    return report


def evaluate(cfg: Config, run_dir: Path) -> dict:
    """Re-evaluate ``run_dir/checkpoints/best.safetensors`` on the validation split."""
    from safetensors.torch import load_file

    run_dir = Path(run_dir)
    best = run_dir / "checkpoints" / "best.safetensors"
    if not best.is_file():
        raise FileNotFoundError(f"{best} not found: is {run_dir} a finished `domainfm finetune explora` run?")
    train, val, classes, _ = build_datasets(cfg)
    model, _ = build_model(cfg, len(classes), None)
    _prepare(model, cfg)
    model.load_state_dict(load_file(str(best)))
    recipe = ClassificationRecipe(model, train, val, task="multiclass", label_smoothing=cfg.label_smoothing)
    train_cfg = copy.deepcopy(cfg.train)
    return Trainer(train_cfg, run_dir=None).evaluate(recipe)
