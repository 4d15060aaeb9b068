"""ExPLoRA extended pretraining (Khanna et al., ICML 2025, https://arxiv.org/abs/2406.10973).

A natural-image ViT continues its own self-supervised objective on a new domain while only
LoRA (rank 64, on q and v of every block but the last), the last block, every norm and the
class/register tokens train (``domainfm.lora`` preset ``"explora"``). Two objectives:

**DINOv2** (``objective: dino``; DINOv2, Oquab et al. 2023). Student and EMA teacher share the
backbone architecture and one DINO head (MLP 3 layers, hidden 2048, bottleneck 256, weight-normed
prototypes 65,536, trained from scratch), used for both the class token (DINO) and masked patch
tokens (iBOT). With :math:`P_t = \\mathrm{softmax}((h_t - c)/\\tau_t)` (centre :math:`c`, EMA
0.9 of the teacher's batch means) and :math:`\\log P_s = \\mathrm{log\\_softmax}(h_s/0.1)`:

.. math::
    L_{DINO} = \\frac{1}{n_g(n_g-1) + n_g n_l} \\sum_{s \\ne t} \\frac1B \\sum_b -P_t^{(b)} \\cdot \\log P_s^{(b)},
    \\quad
    L_{iBOT} = \\frac{1}{n_g B} \\sum_{i} \\frac{1}{|M_i|} \\sum_{p \\in M_i} -P_{t,p} \\cdot \\log P_{s,p},
    \\quad
    L_{KoLeo} = -\\frac1B \\sum_b \\log \\min_{b' \\ne b} \\lVert \\hat z_b - \\hat z_{b'} \\rVert

(s over the student's 2 global + n_l local crops, t over the teacher's 2 global crops, a crop
never compared with itself; :math:`M_i` the masked patches of global crop i, the sum over every
global crop, masked or not; KoLeo on the student's L2-normalised class tokens, per global crop).
Loss = :math:`L_{DINO} + 0.1 \\sum_{crops} L_{KoLeo} + L_{iBOT}`, as DINOv2's ``ssl_meta_arch``.
Schedules (per optimizer step): teacher temperature 0.04→0.07 linearly over the warm-up, then
constant; teacher momentum 0.992→1 (cosine); weight decay 0.04→0.4 (cosine); the head's last
layer gets no update for ``freeze_last_layer_steps``.

The teacher is a deep copy of the student *with its adapters unmerged*; it is frozen
(``requires_grad=False``), never merged (``domainfm.lora.merge`` is never implicit, not even on
``eval()``, which is the official code's pitfall) and only moved by the EMA over the student's
trainable parameters (frozen ones are identical in both, so their EMA is the identity).
It lives in :class:`DinoPretrainer` beside (not inside) the student, so the engine checkpoints
it with the run and resumes it exactly.

**MAE** (``objective: mae``; He et al. 2022): mask 75 % of the patch tokens, encode the rest,
decode with a light transformer and regress normalised pixels of the masked patches. Encoder:
the explora preset; decoder: LoRA rank 8 on q, v plus its embedding/norm/prediction layers.
Works on timm ViTs and on the multispectral :class:`~domainfm.models.explora.GroupChannelViT`
(per-group masking and per-group pixel heads, as SatMAE).

Simplifications (documented, not hidden): iBOT masks are uniformly random patches (DINOv2 draws
block-wise masks); band-agnostic photometric jitter instead of DINOv2's RGB colour jitter / blur /
solarisation; no layer-wise lr decay or patch-embedding lr multiplier (the patch embedding is
frozen in ExPLoRA anyway); a single process's batch is centred (DINOv2 all-reduces the centre).
"""
from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from domainfm import lora
from domainfm.engine import Recipe, TrainConfig, Trainer, build_param_groups

__all__ = [
    "Config",
    "run",
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


@dataclass
class ModelSection:
    name: str = "explora-test"
    #: a file/dir/URL for ``create_model(pretrained=...)``, ``true`` for the card's source, or null
    pretrained: str | None = None
    #: what to do when the weights cannot be had offline: ``error`` or ``random`` (explicit)
    pretrained_fallback: str = "error"
    kwargs: dict = field(default_factory=dict)
    drop_path_rate: float = 0.3


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
class DinoSection:
    n_prototypes: int = 65536
    hidden_dim: int = 2048
    bottleneck_dim: int = 256
    n_layers: int = 3
    dino_weight: float = 1.0
    ibot_weight: float = 1.0
    koleo_weight: float = 0.1
    student_temp: float = 0.1
    center_momentum: float = 0.9
    warmup_teacher_temp: float = 0.04
    teacher_temp: float = 0.07
    #: fraction of the run over which the teacher temperature warms up (DINOv2: 30 of 100 epochs)
    teacher_temp_warmup_fraction: float = 0.3
    momentum_teacher: float = 0.992
    final_momentum_teacher: float = 1.0
    weight_decay_end: float = 0.4
    freeze_last_layer_steps: int = 0
    mask_probability: float = 0.5
    mask_ratio: list[float] = field(default_factory=lambda: [0.1, 0.5])
    mask_token_trainable: bool = False
    global_size: int = 224
    local_size: int = 98
    n_local: int = 8
    global_scale: list[float] = field(default_factory=lambda: [0.32, 1.0])
    local_scale: list[float] = field(default_factory=lambda: [0.05, 0.32])
    jitter: float = 0.2


@dataclass
class MaeSection:
    mask_ratio: float = 0.75
    norm_pix_loss: bool = True
    img_size: int = 224
    crop_scale: list[float] = field(default_factory=lambda: [0.2, 1.0])
    decoder_dim: int = 512
    decoder_depth: int = 8
    decoder_heads: int = 16
    decoder_channel_embed: int = 128
    decoder_lora_rank: int = 8
    decoder_lora_alpha: float = 8.0


@dataclass
class Config:
    objective: str = "dino"
    model: ModelSection = field(default_factory=ModelSection)
    adapter: AdapterSection = field(default_factory=AdapterSection)
    data: DataSection = field(default_factory=DataSection)
    dino: DinoSection = field(default_factory=DinoSection)
    mae: MaeSection = field(default_factory=MaeSection)
    train: TrainConfig = field(default_factory=TrainConfig)
    #: write the merged backbone (``backbone/``, our format) and the adapter (``adapter/``)
    export: bool = True
    #: also write the starting backbone (``init_backbone/``), for a like-for-like baseline
    export_init: bool = False

    def __post_init__(self):
        if self.objective not in {"dino", "mae"}:
            raise ValueError(f"objective={self.objective!r}: expected 'dino' or 'mae'")
        if self.model.pretrained_fallback not in {"error", "random"}:
            raise ValueError(f"model.pretrained_fallback={self.model.pretrained_fallback!r}: expected 'error' or 'random'")


# ============================================================================ losses (functional)


def teacher_probs(teacher_logits: torch.Tensor, center: torch.Tensor, temperature: float) -> torch.Tensor:
    """Centred, sharpened teacher distribution ``softmax((t - c) / temp)`` (fp32)."""
    return F.softmax((teacher_logits.float() - center.float()) / temperature, dim=-1)


@torch.no_grad()
def update_center(center: torch.Tensor, teacher_logits: torch.Tensor, momentum: float) -> torch.Tensor:
    """``c <- m c + (1 - m) mean_b(t_b)`` in place; ``teacher_logits`` is ``(N, K)``."""
    batch_mean = teacher_logits.float().reshape(-1, teacher_logits.shape[-1]).mean(dim=0, keepdim=True)
    center.mul_(momentum).add_(batch_mean.reshape(center.shape), alpha=1 - momentum)
    return center


def dino_loss(student_logits: Sequence[torch.Tensor], teacher_p: Sequence[torch.Tensor], student_temp: float,
              n_global: int = 2) -> torch.Tensor:
    """DINO cross-entropy over crop pairs, averaged over pairs (DINOv2's normalisation).

    ``student_logits``: the student's head outputs per crop, global crops first (each ``(B, K)``);
    ``teacher_p``: the teacher's probabilities for the ``n_global`` global crops. Student global
    crop i is never compared with teacher crop i.
    """
    terms, total = 0, 0.0
    for i, s in enumerate(student_logits):
        log_p = F.log_softmax(s.float() / student_temp, dim=-1)
        for j, t in enumerate(teacher_p):
            if i < n_global and i == j:
                continue
            total = total - (t * log_p).sum(dim=-1).mean()
            terms += 1
    return total / max(terms, 1)


def ibot_loss(student_masked_logits: torch.Tensor, teacher_masked_p: torch.Tensor, masks: torch.Tensor,
              student_temp: float) -> torch.Tensor:
    """iBOT masked-patch cross-entropy.

    ``student_masked_logits`` / ``teacher_masked_p``: ``(M, K)`` for the masked patches in
    ``masks.nonzero()`` order; ``masks``: ``(N_crops, n_patches)`` bool. Each crop's masked
    patches are averaged, then summed over crops and divided by ``N_crops`` (all crops counted).
    """
    if student_masked_logits.shape[0] == 0:
        return student_masked_logits.sum() * 0.0
    ce = -(teacher_masked_p * F.log_softmax(student_masked_logits.float() / student_temp, dim=-1)).sum(dim=-1)
    per_patch_weight = (1.0 / masks.sum(dim=-1).clamp(min=1).float()).unsqueeze(-1).expand_as(masks)[masks]
    return (ce * per_patch_weight).sum() / masks.shape[0]


def koleo_loss(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Kozachenko-Leonenko entropy estimator on L2-normalised rows of ``x`` ``(B, D)``:
    ``-mean_b log(min_{b' != b} ||x_b - x_b'|| + eps)``."""
    x = F.normalize(x.float(), p=2, dim=-1, eps=eps)
    dots = x @ x.t()
    dots.fill_diagonal_(-2.0)  # never pick oneself as the nearest neighbour
    nearest = dots.argmax(dim=1)
    distances = F.pairwise_distance(x, x[nearest], p=2, eps=eps)
    return -torch.log(distances + eps).mean()


# ============================================================================ schedules


def cosine_schedule(start: float, end: float, step: int, total: int) -> float:
    """Cosine from ``start`` (step 0) to ``end`` (step ``total``)."""
    progress = min(max(step / max(total, 1), 0.0), 1.0)
    return end + (start - end) * 0.5 * (1 + math.cos(math.pi * progress))


def teacher_temperature(step: int, total: int, warmup: float, final: float, warmup_fraction: float) -> float:
    """Linear from ``warmup`` to ``final`` over the first ``warmup_fraction`` of the run, then ``final``."""
    warm_steps = int(round(warmup_fraction * total))
    if warm_steps <= 0 or step >= warm_steps:
        return final
    return warmup + (final - warmup) * step / warm_steps


def teacher_momentum(step: int, total: int, start: float, end: float) -> float:
    return cosine_schedule(start, end, step, total)


# ============================================================================ masks and backbone tokens


def random_patch_masks(n_crops: int, n_patches: int, probability: float, ratio: tuple[float, float],
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """``(n_crops, n_patches)`` bool: ``int(n_crops * probability)`` crops get a mask whose ratio
    is drawn from consecutive slices of ``linspace(ratio)`` (as DINOv2's collate), others none."""
    masks = torch.zeros(n_crops, n_patches, dtype=torch.bool)
    n_masked = int(n_crops * probability)
    edges = torch.linspace(ratio[0], ratio[1], n_masked + 1)
    for i in range(n_masked):
        r = float(edges[i] + (edges[i + 1] - edges[i]) * torch.rand((), generator=generator))
        k = int(round(r * n_patches))
        masks[i, torch.randperm(n_patches, generator=generator)[:k]] = True
    return masks[torch.randperm(n_crops, generator=generator)]


def vit_tokens(vit: nn.Module, x: torch.Tensor, masks: torch.Tensor | None = None,
               mask_token: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """timm ViT forward with iBOT masking: masked patch embeddings are replaced by
    ``mask_token`` *before* the position encoding (as DINOv2). Returns the normed class token
    ``(B, D)`` and patch tokens ``(B, N, D)`` (register tokens dropped)."""
    tokens = vit.patch_embed(x)
    if masks is not None:
        flat_shape = tokens.shape[:-1]
        m = masks.reshape(flat_shape).unsqueeze(-1)
        tokens = torch.where(m, mask_token.to(tokens.dtype).reshape(*([1] * (tokens.ndim - 1)), -1), tokens)
    h = vit.norm_pre(vit.patch_drop(vit._pos_embed(tokens)))
    h = vit.norm(vit.blocks(h))
    return h[:, 0], h[:, vit.num_prefix_tokens:]


# ============================================================================ DINO head and pretrainer


class DINOHead(nn.Module):
    """DINOv2's projection head: MLP (``n_layers``, GELU) to a bottleneck, L2 normalisation,
    then weight-normalised prototypes without bias (``g`` initialised to 1).

    **Shapes:** ``(*, in_dim) -> (*, n_prototypes)``.
    """

    def __init__(self, in_dim: int, n_prototypes: int = 65536, hidden_dim: int = 2048, bottleneck_dim: int = 256,
                 n_layers: int = 3):
        super().__init__()
        if n_layers < 1:
            raise ValueError(f"DINOHead: n_layers={n_layers} must be >= 1")
        dims = [in_dim] + [hidden_dim] * (n_layers - 1) + [bottleneck_dim]
        layers: list[nn.Module] = []
        for i in range(n_layers):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if i < n_layers - 1:
                layers.append(nn.GELU())
        self.mlp = nn.Sequential(*layers)
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        self.last_layer_v = nn.Parameter(torch.empty(n_prototypes, bottleneck_dim))
        nn.init.kaiming_uniform_(self.last_layer_v, a=math.sqrt(5))
        self.last_layer_g = nn.Parameter(torch.ones(n_prototypes, 1))

    def last_layer_parameters(self) -> list[nn.Parameter]:
        return [self.last_layer_v, self.last_layer_g]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = F.normalize(self.mlp(x), dim=-1, p=2, eps=1e-6 if x.dtype == torch.float16 else 1e-12)
        weight = self.last_layer_g * self.last_layer_v / self.last_layer_v.norm(dim=1, keepdim=True)
        return F.linear(z, weight)


def _no_drop_path(module: nn.Module) -> None:
    for m in module.modules():
        if hasattr(m, "drop_prob"):
            m.drop_prob = 0.0


class DinoPretrainer(nn.Module):
    """Student (backbone + head), EMA teacher (frozen copy), iBOT mask token and centres.

    ``forward(crops, masks, teacher_temp) -> (loss, logs)``: ``crops`` is ``[global_1, global_2,
    local_1, ...]``, each ``(B, C, h, w)``; ``masks`` ``(2B, N)`` for the global crops.
    The teacher always runs in eval mode and under ``no_grad``.
    """

    def __init__(self, backbone: nn.Module, settings: DinoSection):
        super().__init__()
        self.settings = settings
        self.student = nn.ModuleDict({
            "backbone": backbone,
            "head": DINOHead(backbone.num_features, settings.n_prototypes, settings.hidden_dim,
                             settings.bottleneck_dim, settings.n_layers),
        })
        self.teacher = copy.deepcopy(self.student)
        _no_drop_path(self.teacher)
        self.teacher.requires_grad_(False)
        self.mask_token = nn.Parameter(torch.zeros(1, backbone.embed_dim), requires_grad=settings.mask_token_trainable)
        self.register_buffer("dino_center", torch.zeros(1, settings.n_prototypes))
        self.register_buffer("ibot_center", torch.zeros(1, settings.n_prototypes))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self.teacher.eval()

    def train(self, mode: bool = True):
        super().train(mode)
        self.teacher.eval()
        return self

    def forward(self, crops: list[torch.Tensor], masks: torch.Tensor, teacher_temp: float):
        s = self.settings
        n_global, n_local = 2, len(crops) - 2
        batch = crops[0].shape[0]
        globals_ = torch.cat(crops[:2])
        masks = masks.to(globals_.device)
        with torch.no_grad():
            t_cls, t_patch = vit_tokens(self.teacher["backbone"], globals_)
            t_cls_logits = self.teacher["head"](t_cls)
            t_patch_logits = self.teacher["head"](t_patch[masks])
            t_dino = teacher_probs(t_cls_logits, self.dino_center, teacher_temp)
            t_ibot = teacher_probs(t_patch_logits, self.ibot_center, teacher_temp)
            update_center(self.dino_center, t_cls_logits, s.center_momentum)
            if t_patch_logits.shape[0]:
                update_center(self.ibot_center, t_patch_logits, s.center_momentum)
        # the teacher's crop order is swapped so that student crop A meets teacher crop B
        teacher_chunks = list(t_dino.chunk(n_global))

        backbone, head = self.student["backbone"], self.student["head"]
        s_cls, s_patch = vit_tokens(backbone, globals_, masks, self.mask_token)
        s_cls_logits = head(s_cls)
        s_patch_logits = head(s_patch[masks])
        student_list = list(s_cls_logits.chunk(n_global))
        if n_local:
            local_cls, _ = vit_tokens(backbone, torch.cat(crops[2:]))
            student_list += list(head(local_cls).chunk(n_local))
        l_dino = dino_loss(student_list, teacher_chunks, s.student_temp, n_global=n_global)
        l_koleo = sum(koleo_loss(c) for c in s_cls.chunk(n_global)) if s.koleo_weight > 0 else s_cls.sum() * 0
        l_ibot = ibot_loss(s_patch_logits, t_ibot, masks, s.student_temp)
        loss = s.dino_weight * l_dino + s.koleo_weight * l_koleo + s.ibot_weight * l_ibot
        logs = {"dino": l_dino.detach(), "koleo": l_koleo.detach(), "ibot": l_ibot.detach(),
                "masked_patches": float(masks.sum()), "batch": batch}
        return loss, logs


class DinoRecipe(Recipe):
    """DINOv2 extended pretraining on the engine; schedules follow ``DinoSection``."""

    def __init__(self, pretrainer: DinoPretrainer, train_dataset, *, n_patches: int, seed: int = 0,
                 base_weight_decay: float = 0.04):
        from domainfm.data_loaders.satellite import multicrop_collate

        self.model, self.train_dataset = pretrainer, train_dataset
        self.collate_fn = multicrop_collate
        self.settings = pretrainer.settings
        self.n_patches = n_patches
        self.base_weight_decay = base_weight_decay
        self.total_steps = 1
        self.generator = torch.Generator().manual_seed(seed)
        for p in pretrainer.student["head"].last_layer_parameters():
            p.register_hook(self._freeze_last_layer_hook)

    def _freeze_last_layer_hook(self, grad: torch.Tensor) -> torch.Tensor:
        # DINOv2 cancels the prototypes' gradient for the first epochs (stabilises the start)
        if int(self.model.step) < self.settings.freeze_last_layer_steps:
            return torch.zeros_like(grad)
        return grad

    def param_groups(self, model: nn.Module, config: TrainConfig):
        cfg = TrainConfig(**{**config.__dict__, "weight_decay": self.base_weight_decay})
        return build_param_groups(model, cfg)

    def current_teacher_temp(self) -> float:
        s = self.settings
        return teacher_temperature(int(self.model.step), self.total_steps, s.warmup_teacher_temp, s.teacher_temp,
                                   s.teacher_temp_warmup_fraction)

    def step(self, model, crops):
        b2 = crops[0].shape[0] * 2
        masks = random_patch_masks(b2, self.n_patches, self.settings.mask_probability,
                                   tuple(self.settings.mask_ratio), self.generator)
        loss, logs = model(crops, masks, self.current_teacher_temp())
        logs["teacher_temp"] = self.current_teacher_temp()
        return loss, logs

    @torch.no_grad()
    def on_train_step_end(self, model: nn.Module, step: int, total_steps: int) -> None:
        self.total_steps = total_steps
        s = self.settings
        m = teacher_momentum(step - 1, total_steps, s.momentum_teacher, s.final_momentum_teacher)
        student = dict(model.student.named_parameters())
        teacher = dict(model.teacher.named_parameters())
        for name, p in student.items():
            if p.requires_grad:
                teacher[name].mul_(m).add_(p.detach(), alpha=1 - m)
        model.step.fill_(step)

    def before_optimizer_step(self, optimizer, step: int, total_steps: int) -> None:
        # set on the live optimizer each step, so a resumed run continues the schedule exactly
        wd = cosine_schedule(self.base_weight_decay, self.settings.weight_decay_end, step, total_steps)
        for g in optimizer.param_groups:
            if g.get("weight_decay", 0) > 0:
                g["weight_decay"] = wd


# ============================================================================ MAE


def _patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """``(B, C, H, W) -> (B, N, p*p*C)``, patches row-major, pixels (p, p, C) as MAE."""
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // p, p, w // p, p)
    return torch.einsum("bchpwq->bhwpqc", x).reshape(b, (h // p) * (w // p), p * p * c)


class MaeDecoder(nn.Module):
    """MAE's light decoder on timm Blocks: embed, re-insert mask tokens, fixed sin-cos positions
    (+ a channel-group code for group-channel encoders), blocks, norm, pixel head(s)."""

    def __init__(self, enc_dim: int, n_patches: int, patch_pixels: Sequence[int], n_groups: int = 1,
                 dim: int = 512, depth: int = 8, heads: int = 16, channel_embed: int = 128):
        super().__init__()
        from timm.models.vision_transformer import Block

        from domainfm.models.explora.satmae import sincos_1d, sincos_2d

        grid = int(round(math.sqrt(n_patches)))
        self.n_groups = n_groups
        self.decoder_embed = nn.Linear(enc_dim, dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.normal_(self.mask_token, std=0.02)
        pos_dim = dim - channel_embed if n_groups > 1 else dim
        self.register_buffer("pos", torch.from_numpy(sincos_2d(pos_dim, grid)).float().unsqueeze(0), persistent=False)
        if n_groups > 1:
            chan = torch.from_numpy(sincos_1d(channel_embed, np.arange(n_groups))).float()
            self.register_buffer("chan", chan.unsqueeze(0), persistent=False)
        self.decoder_blocks = nn.Sequential(*[Block(dim, heads, qkv_bias=True) for _ in range(depth)])
        self.decoder_norm = nn.LayerNorm(dim)
        self.decoder_pred = nn.ModuleList(nn.Linear(dim, n) for n in patch_pixels)

    def encodings(self, n_patches: int) -> torch.Tensor:
        pos = self.pos[:, 1:]
        if self.n_groups == 1:
            return pos
        g = self.n_groups
        pos = pos.unsqueeze(1).expand(-1, g, -1, -1)
        chan = self.chan.unsqueeze(2).expand(-1, -1, n_patches, -1)
        return torch.cat([pos, chan], dim=-1).flatten(1, 2)

    def forward(self, latent: torch.Tensor, restore: torch.Tensor, n_patches: int) -> list[torch.Tensor]:
        x = self.decoder_embed(latent)
        cls, kept = x[:, :1], x[:, 1:]
        n_tokens = restore.shape[1]
        fill = self.mask_token.expand(x.shape[0], n_tokens - kept.shape[1], -1)
        full = torch.cat([kept, fill], dim=1)
        full = torch.gather(full, 1, restore.unsqueeze(-1).expand(-1, -1, full.shape[-1]))
        full = full + self.encodings(n_patches)
        cls = cls + self.pos[:, :1, : cls.shape[-1]] if self.n_groups == 1 else cls
        h = self.decoder_norm(self.decoder_blocks(torch.cat([cls, full], dim=1)))[:, 1:]
        per_group = h.reshape(h.shape[0], self.n_groups, n_patches, -1)
        return [pred(per_group[:, i]) for i, pred in enumerate(self.decoder_pred)]


class MaePretrainer(nn.Module):
    """MAE on a timm ViT or a :class:`GroupChannelViT`: ``forward(images) -> (loss, logs)``."""

    def __init__(self, encoder: nn.Module, settings: MaeSection):
        super().__init__()
        from domainfm.models.explora.satmae import GroupChannelViT

        self.settings = settings
        self.encoder = encoder
        self.grouped = isinstance(encoder, GroupChannelViT)
        if self.grouped:
            p, n = encoder.patch_size, encoder.num_patches
            groups = encoder.channel_groups
            pixels = [p * p * len(g) for g in groups]
        else:
            p = encoder.patch_embed.patch_size[0]
            n = encoder.patch_embed.num_patches
            groups = [tuple(range(encoder.patch_embed.proj.in_channels))]
            pixels = [p * p * len(groups[0])]
        self.patch, self.n_patches, self.groups = p, n, [list(g) for g in groups]
        self.decoder = MaeDecoder(encoder.embed_dim, n, pixels, n_groups=len(groups), dim=settings.decoder_dim,
                                  depth=settings.decoder_depth, heads=settings.decoder_heads,
                                  channel_embed=settings.decoder_channel_embed)

    def _tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(prefix tokens with encodings, patch tokens with encodings ``(B, T, D)``)."""
        enc = self.encoder
        if self.grouped:
            return enc.cls_with_pos(x.shape[0]), enc.embed_groups(x).flatten(1, 2)
        h = enc._pos_embed(enc.patch_embed(x))
        return h[:, : enc.num_prefix_tokens], h[:, enc.num_prefix_tokens:]

    def forward(self, images: torch.Tensor):
        s = self.settings
        prefix, tokens = self._tokens(images)
        b, t, d = tokens.shape
        n_keep = max(1, int(round(t * (1 - s.mask_ratio))))
        noise = torch.rand(b, t, device=tokens.device)
        shuffle = noise.argsort(dim=1)
        restore = shuffle.argsort(dim=1)
        kept = torch.gather(tokens, 1, shuffle[:, :n_keep].unsqueeze(-1).expand(-1, -1, d))
        mask = torch.ones(b, t, device=tokens.device)
        mask[:, :n_keep] = 0
        mask = torch.gather(mask, 1, restore)  # 1 = masked, in token order
        enc = self.encoder
        h = torch.cat([prefix, kept], dim=1)
        if not self.grouped:
            h = enc.norm_pre(h)
        h = enc.norm(enc.blocks(h))
        if not self.grouped and enc.num_prefix_tokens > 1:  # drop registers, keep the class token
            h = torch.cat([h[:, :1], h[:, enc.num_prefix_tokens:]], dim=1)
        preds = self.decoder(h, restore, self.n_patches)
        mask = mask.reshape(b, len(self.groups), self.n_patches)
        losses, weights = [], []
        for gi, (pred, bands) in enumerate(zip(preds, self.groups)):
            target = _patchify(images[:, bands], self.patch)
            if s.norm_pix_loss:
                mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
                target = (target - mean) / (var + 1e-6) ** 0.5
            per_patch = ((pred.float() - target.float()) ** 2).mean(dim=-1)
            losses.append((per_patch * mask[:, gi]).sum())
            weights.append(mask[:, gi].sum())
        loss = sum(losses) / torch.stack(weights).sum().clamp(min=1)
        return loss, {"masked_fraction": float(mask.mean())}


class MaeRecipe(Recipe):
    def __init__(self, pretrainer: MaePretrainer, train_dataset):
        self.model, self.train_dataset = pretrainer, train_dataset

    def step(self, model, images):
        return model(images)


# ============================================================================ entry


def build_backbone(section: ModelSection, *, extra_kwargs: dict | None = None) -> tuple[nn.Module, str]:
    """``create_model`` with the config's weights; returns ``(model, init description)``.

    Weights that cannot be had raise, unless ``pretrained_fallback: random`` says to continue
    from random init, which is then printed and reported as ``"random"``.
    """
    from domainfm import create_model
    from domainfm.hub import HubError

    kwargs = {**section.kwargs, **(extra_kwargs or {})}
    pretrained: Any = section.pretrained
    if isinstance(pretrained, str) and pretrained.lower() in {"true", "yes"}:
        pretrained = True
    if not pretrained:
        return create_model(section.name, **kwargs), "random"
    try:
        if isinstance(pretrained, str) and Path(pretrained).suffix in {".pth", ".pt"} and Path(pretrained).is_file():
            from domainfm.models.explora.convert import load_official

            model = create_model(section.name, **kwargs)
            load_official(model, pretrained)
        else:
            model = create_model(section.name, pretrained=pretrained, **kwargs)
        return model, f"pretrained: {pretrained if pretrained is not True else section.name}"
    except (HubError, FileNotFoundError) as exc:
        if section.pretrained_fallback != "random":
            raise HubError(
                f"cannot load weights for {section.name} ({exc}). Place the file where the message says, pass "
                "model.pretrained=/path/to/file, or set model.pretrained_fallback=random to start from random init."
            ) from exc
        print(f"[explora] no pretrained weights for {section.name}: {exc}\n"
              "[explora] model.pretrained_fallback=random: starting from RANDOM initialisation.")
        return create_model(section.name, **kwargs), "random"


def apply_adapter(model: nn.Module, section: AdapterSection) -> nn.Module:
    if not section.enabled:
        model.requires_grad_(True)
        _refreeze_fixed(model)
        return model
    preset = lora.PRESETS[section.preset]
    values = dict(preset(model) if callable(preset) else preset)
    lora.apply(model, preset=section.preset, rank=section.rank, alpha=section.alpha,
               unfreeze=list(values["unfreeze"]) + list(section.extra_unfreeze))
    return model


def _refreeze_fixed(model: nn.Module) -> None:
    # sin-cos tables of the group-channel ViT are fixed by design, also in full training
    for name in ("pos_embed", "channel_embed"):
        p = getattr(model, name, None)
        from domainfm.models.explora.satmae import GroupChannelViT

        if isinstance(model, GroupChannelViT) and isinstance(p, nn.Parameter):
            p.requires_grad_(False)


def load_scene(data: DataSection):
    """(normalised scene ``(C, H, W)`` float tensor, raw scene array, band names, BandStats)."""
    from domainfm.data_loaders import satellite as S

    if data.source == "sample":
        raster = S.read_raster(S.sample_scene_path(), bands=data.bands)
    elif data.source == "raster":
        paths = data.paths or ([data.path] if data.path else [])
        if not paths:
            raise ValueError("data.source=raster needs data.path or data.paths")
        raster = S.read_raster(paths if len(paths) > 1 else paths[0], bands=data.bands)
    else:
        raise ValueError(f"load_scene: data.source={data.source!r} is not a raster source")
    raw = raster.data.astype(np.float32)
    stats = S.BandStats(data.mean, data.std) if data.mean is not None else S.BandStats.compute(raw, raster.nodata)
    if stats.n_bands != raw.shape[0]:
        raise ValueError(f"data.mean/std have {stats.n_bands} values but data.bands selects {raw.shape[0]} bands")
    return stats.normalize(torch.from_numpy(raw)), raw, raster.band_names, stats


def pretrain_dataset(data: DataSection, transform):
    """Unlabelled images for pretraining, each passed through ``transform``."""
    from domainfm.data_loaders import satellite as S

    if data.source in {"sample", "raster"}:
        scene, _, _, _ = load_scene(data)
        return S.SceneTiles(scene, data.tile_size, data.stride, transform=transform)
    if data.mean is None or data.std is None:
        raise ValueError(f"data.source={data.source!r} needs data.mean and data.std (per-band statistics)")
    stats = S.BandStats(data.mean, data.std)
    if data.source == "folder":
        ds = S.ImageFolder(data.path, n_bands=data.n_bands, bands=data.band_indices, stats=stats)
    elif data.source == "csv":
        ds = S.CsvManifest(data.path, n_bands=data.n_bands, bands=data.band_indices, stats=stats)
    else:
        raise ValueError(f"data.source={data.source!r}: expected sample, raster, folder or csv")
    return _Unlabelled(ds, transform)


class _Unlabelled(torch.utils.data.Dataset):
    def __init__(self, ds, transform):
        self.ds, self.transform = ds, transform

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return self.transform(self.ds[i][0])


def run(cfg: Config, run_dir: Path) -> dict:
    from domainfm import hub
    from domainfm.data_loaders import satellite as S

    run_dir = Path(run_dir)
    torch.manual_seed(cfg.train.seed)
    random.seed(cfg.train.seed)
    extra = {"n_outputs": 0, "drop_path_rate": cfg.model.drop_path_rate}
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
        report["backbone_dir"] = str(run_dir / "backbone")
    return report
