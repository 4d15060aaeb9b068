"""The FIM temporal imputation model (official ``FIMImpTempBase`` / ``FIMImpTemp``,
``src/fim/models/imputation_temporal.py``).

The series is cut into windows and one window (the gap) is missing. Every observed window is
embedded by the local model's branch net (after a global MinMax over all windows, then the local
MinMax per window); nine *scale features* per window (min/max/range of its times, of its values,
its first and last observed value and their difference, on the globally normalised data) go
through a linear map; ``[embedding, scale features]`` of the windows pass a second transformer
(``psi_2``, same block structure as the branch net) that pools them into one embedding. With it,
the local model's trunk/combiner give the drift on the gap's evaluation times (MinMax-normalised
over the gap), which is integrated forward from the left boundary value and backward from the
right one (Simpson, as the local model) and blended linearly: ``(1-a) left + a right``,
``a = linspace(0, 1)`` over the gap. The boundary values default to the local model's
interpolation of the two neighbouring windows at their last / first observed point, as
``FIMImpTemp.forward(imputation_window_index=...)`` does.

Deviation, stated: upstream returns the gap's drift divided a second time by the global time
range; we return the drift the returned path integrates (``d values / d t`` in the original
units).

**Shapes:** :meth:`FIMTemporalImputer.impute_gap` takes windows ``(B, W, K, D)`` of the observed
part, their times ``(B, W, K)``, ``observed (B, W, K, D)``, gap times ``(B, L)`` and the index of
the first window right of the gap; returns ``values``, ``drift_mean``, ``drift_std`` ``(B, L, D)``.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .fim import RANGE_EPS, BranchNet, FIMImputer, FIMInputError, _interleave_midpoints, simpson_path

__all__ = ["FIMTemporalImputer", "scale_features"]


def _masked_minmax(x: Tensor, missing: Tensor, dims) -> tuple[Tensor, Tensor]:
    low = x.masked_fill(missing, math.inf).amin(dim=dims, keepdim=True)
    high = x.masked_fill(missing, -math.inf).amax(dim=dims, keepdim=True)
    return low, high - low + RANGE_EPS


def scale_features(times: Tensor, values: Tensor, missing: Tensor) -> Tensor:
    """Per window: min/max/range of observed times, of observed values, first/last observed value
    and last - first. ``(N, W, K)`` x3 -> ``(N, W, 9)``."""
    observed = ~missing
    t_min = times.masked_fill(missing, math.inf).amin(-1)
    t_max = times.masked_fill(missing, -math.inf).amax(-1)
    v_min = values.masked_fill(missing, math.inf).amin(-1)
    v_max = values.masked_fill(missing, -math.inf).amax(-1)
    first = observed.int().argmax(-1, keepdim=True)
    last = observed.int().cumsum(-1).argmax(-1, keepdim=True)
    v_first, v_last = values.gather(-1, first)[..., 0], values.gather(-1, last)[..., 0]
    return torch.stack([t_min, t_max, t_max - t_min, v_min, v_max, v_max - v_min, v_first, v_last,
                        v_last - v_first], dim=-1)


class FIMTemporalImputer(nn.Module):
    """Local model + window transformer + scale-feature map (official ``FIMImpTempBase``).

    Args: ``local_kwargs`` for the :class:`FIMImputer`; ``n_heads``, ``n_blocks``, ``mlp_hidden``
    of the window transformer (8, 3, 512 upstream: ``psi_2`` with ``num_encoder_blocks = 4``);
    ``dropout``; ``n_outputs`` as in :class:`FIMImputer`.
    """

    def __init__(self, local_kwargs: dict | None = None, n_heads: int = 8, n_blocks: int = 3, mlp_hidden: int = 512,
                 dropout: float = 0.1, n_outputs: int | None = None):
        super().__init__()
        self.local = FIMImputer(**{"dropout": dropout, **(local_kwargs or {})})
        d = self.local.dim_latent
        self.num_features = d
        self.window_transformer = BranchNet(2 * d, d, n_heads, n_blocks, mlp_hidden, dropout)
        self.scale_features = nn.Linear(9, d)
        self.n_outputs = None
        self.head: nn.Module = nn.Identity()
        if n_outputs is not None:
            self.reset_classifier(n_outputs)

    def _gap_rows(self, times, values, missing, gap_times, left, right):
        """Rows of one channel: ``times, values, missing (N, W, K)``, ``gap_times (N, L)``,
        boundary values ``left, right (N,)`` -> dict of ``(N, L)``."""
        n, w, k = values.shape
        if missing.all(dim=-1).any():
            row, win = missing.all(dim=-1).nonzero()[0].tolist()
            raise FIMInputError(f"window {win} of series row {row} has no observed point")
        values = torch.where(missing, torch.zeros_like(values), values)
        x_min, x_rng = _masked_minmax(values, missing, (1, 2))
        t_min, t_rng = _masked_minmax(times, missing, (1, 2))
        vg, tg = (values - x_min) / x_rng, (times - t_min) / t_rng
        tl, vl, _, _ = self.local.normalise(tg.reshape(n * w, k), vg.reshape(n * w, k), missing.reshape(n * w, k))
        emb = self.local.encode(tl, vl, missing.reshape(n * w, k)).view(n, w, -1)
        feats = self.scale_features(scale_features(tg, vg, missing))
        pooled = self.window_transformer(torch.cat([emb, feats], dim=-1))
        # the gap's times are MinMax-normalised on their own (no mask); values stay globally normalised
        g_min = gap_times.amin(dim=1, keepdim=True)
        g_rng = gap_times.amax(dim=1, keepdim=True) - g_min + RANGE_EPS
        fine = _interleave_midpoints((gap_times - g_min) / g_rng)
        mean_n, log_std_n = self.local.drift(pooled, fine)
        grid = fine * g_rng + g_min
        mean = mean_n / g_rng
        left_path = simpson_path((left - x_min[:, 0, 0]) / x_rng[:, 0, 0], grid, mean)
        right_path = simpson_path((right - x_min[:, 0, 0]) / x_rng[:, 0, 0], grid.flip(1), mean.flip(1)).flip(1)
        alpha = torch.linspace(0, 1, gap_times.shape[1], dtype=values.dtype, device=values.device)[None]
        path = ((1 - alpha) * left_path + alpha * right_path) * x_rng[:, 0] + x_min[:, 0]
        scale = x_rng[:, 0] / g_rng
        return {"values": path, "drift_mean": mean[:, 0::2] * x_rng[:, 0],
                "drift_std": torch.exp(log_std_n[:, 0::2]) * scale}

    def impute_gap(self, times: Tensor, values: Tensor, observed: Tensor, gap_times: Tensor, gap_index: int, *,
                   left: Tensor | None = None, right: Tensor | None = None) -> dict[str, Tensor]:
        """Impute the gap between window ``gap_index - 1`` and window ``gap_index``.

        ``left`` / ``right`` ``(B, D)``: boundary values; by default the local model's
        interpolation of the neighbouring windows at their last / first observed point.
        """
        if values.dim() != 4:
            raise FIMInputError(f"values: shape {tuple(values.shape)}; expected (B, W, K, D)")
        b, w, k, d = values.shape
        if not 1 <= gap_index <= w - 1:
            raise FIMInputError(f"gap_index={gap_index}: the gap must have an observed window on each side (1..{w - 1})")
        if times.shape != (b, w, k):
            raise FIMInputError(f"times: shape {tuple(times.shape)}; expected {(b, w, k)}")
        rows = lambda x: x.permute(0, 3, 1, 2).reshape(b * d, w, k)  # noqa: E731
        r_times = times[:, None].expand(-1, d, -1, -1).reshape(b * d, w, k)
        r_values, r_missing = rows(values), ~rows(observed.bool())
        r_gap = gap_times[:, None].expand(-1, d, -1).reshape(b * d, -1)
        if left is None or right is None:
            sides = []
            for win, pick_last in ((gap_index - 1, True), (gap_index, False)):
                out = self.local.local(r_times[:, win], r_values[:, win], r_missing[:, win], r_times[:, win])
                obs = (~r_missing[:, win]).int()
                idx = obs.cumsum(-1).argmax(-1) if pick_last else obs.argmax(-1)
                sides.append(out["values"].gather(-1, idx[:, None])[:, 0])
            r_left, r_right = sides
        else:
            r_left, r_right = left.reshape(b * d), right.reshape(b * d)
        out = self._gap_rows(r_times, r_values, r_missing, r_gap, r_left, r_right)
        return {key: v.view(b, d, -1).permute(0, 2, 1) for key, v in out.items()}

    def forward(self, times: Tensor, values: Tensor, observed: Tensor, gap_times: Tensor) -> dict[str, Tensor]:
        """:meth:`impute_gap` with the gap in the middle of the windows (``gap_index = W // 2``)."""
        return self.impute_gap(times, values, observed, gap_times, values.shape[1] // 2)

    def concepts(self, *args, **kwargs) -> dict[str, Tensor]:
        """The local model's :meth:`FIMImputer.concepts` (pretraining trains the local model)."""
        return self.local.concepts(*args, **kwargs)

    def impute(self, *args, **kwargs) -> dict[str, Tensor]:
        """The local model's :meth:`FIMImputer.impute` (FIM-ℓ with ``windows=K``)."""
        return self.local.impute(*args, **kwargs)

    def forward_features(self, times: Tensor, values: Tensor, observed: Tensor) -> Tensor:
        return self.local.forward_features(times, values, observed)

    def forward_head(self, features: Tensor, pre_logits: bool = False) -> Tensor:
        pooled = features.mean(dim=1) if features.dim() == 3 else features
        return pooled if pre_logits else self.head(pooled)

    def reset_classifier(self, n_outputs: int | None) -> None:
        self.n_outputs = n_outputs
        self.head = nn.Linear(self.num_features, n_outputs) if n_outputs else nn.Identity()
