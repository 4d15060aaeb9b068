"""ExPLoRA's DINOv2 objective: losses, schedules, the DINO head, the student/teacher pair
and its recipe (Khanna et al., ICML 2025; DINOv2, Oquab et al. 2023).

**DINOv2** (``objective: dino``). Student and EMA teacher share the
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

Simplifications (documented, not hidden): iBOT masks are uniformly random patches (DINOv2 draws
block-wise masks); band-agnostic photometric jitter instead of DINOv2's RGB colour jitter / blur /
solarisation; no layer-wise lr decay or patch-embedding lr multiplier (the patch embedding is
frozen in ExPLoRA anyway); a single process's batch is centred (DINOv2 all-reduces the centre).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from domainfm.engine import Recipe, TrainConfig, build_param_groups

__all__ = [
    "DinoSection",
    "DINOHead",
    "DinoPretrainer",
    "DinoRecipe",
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
