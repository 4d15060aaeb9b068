"""FIM-ℓ on sparse data: a window without observations no longer fails; rows whose windows would hold
fewer than eight observations are imputed with fewer, larger windows (merged), other rows as before; the
window count follows the observation density when none is given."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import domainfm
from domainfm.models.fim import balanced_windows, overlapping_window_slices


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return domainfm.create_model("fim-imputation-test").double().eval()


def _fewest_ok(observed_row: np.ndarray, n_windows: int, overlap: float) -> int:
    """Independent restatement: the most windows <= n_windows whose every window holds >= 8 observations."""
    for k in range(n_windows, 0, -1):
        size, stride = balanced_windows(len(observed_row), k, overlap)
        slices = overlapping_window_slices(len(observed_row), k, size, stride).tolist()
        if all(observed_row[s:e].sum() >= 8 for s, e in slices):
            return k
    return 1


def test_fim_l_with_a_window_without_observations_merges_windows(model):
    t = torch.linspace(0, 10, 160, dtype=torch.float64)
    values = torch.stack([torch.sin(t), torch.cos(0.7 * t) + 1, 0.1 * t], dim=0)[..., None]  # (3, 160, 1)
    observed = torch.rand(3, 160, 1, generator=torch.Generator().manual_seed(0)) < 0.6
    observed[1, 40:100] = False  # row 1: a 60-point hole swallows whole windows of 8
    observed[2, 60:] = False  # row 2: nothing after point 60
    observed[:, 0] = True
    with torch.no_grad():
        out = model.impute(t, values, observed, t, windows=8)
        for row in range(3):
            k = _fewest_ok(observed[row, :, 0].numpy(), 8, 0.25)
            assert (k == 8) == (row == 0)
            alone = model.impute(t, values[row:row + 1], observed[row:row + 1], t, windows=k if k > 1 else None)
            for key in ("values", "values_std", "drift_mean", "drift_std", "init_mean", "init_std"):
                torch.testing.assert_close(out[key][row], alone[key][0], rtol=1e-9, atol=1e-9)
    assert torch.isfinite(out["values"]).all()


def test_window_count_follows_the_observation_density():
    from domainfm.models.fim.fim import auto_window_count

    # about 32 observations per window (the middle of the prior's 8-64), at most 128 points per window
    t = torch.arange(1000, dtype=torch.float64)
    dense = torch.ones(1, 1000, 1, dtype=torch.bool)
    k = auto_window_count(1000, dense, overlap=0.25)
    size, _ = balanced_windows(1000, k, 0.25)
    assert abs(size - 32) <= 2
    sparse = torch.zeros(1, 1000, 1, dtype=torch.bool)
    sparse[0, ::20] = True  # 50 observations: windows of 128 points (6.4 observations each) at most
    k = auto_window_count(1000, sparse, overlap=0.25)
    assert abs(balanced_windows(1000, k, 0.25)[0] - 128) <= 4
    short = torch.ones(1, 100, 1, dtype=torch.bool)
    short[0, 50:] = False  # 50 observations on 100 points: ~64-point windows wanted; 2 windows of 57 are closest
    assert auto_window_count(100, short, 0.25) == 2 and balanced_windows(100, 2, 0.25)[0] == 57
    # 40 dense points: one window of 40 is closer to 32 than two of 23
    assert auto_window_count(40, torch.ones(1, 40, 1, dtype=torch.bool), 0.25) == 1


def test_impute_windows_auto(model):
    from domainfm.models.fim.fim import auto_window_count

    t = torch.linspace(0, 10, 300, dtype=torch.float64)
    values = torch.sin(t)[None, :, None]
    observed = torch.ones(1, 300, 1, dtype=torch.bool)
    with torch.no_grad():
        auto = model.impute(t, values, observed, t, windows="auto")["values"]
        k = auto_window_count(300, observed, 0.25)
        want = model.impute(t, values, observed, t, windows=k)["values"]
    assert k > 1
    torch.testing.assert_close(auto, want, rtol=0, atol=0)


def test_window_counts_whose_windows_run_past_the_grid_are_avoided_or_named(model):
    from domainfm.models.fim import FIMInputError
    from domainfm.models.fim.fim import auto_window_count, merged_window_counts, windows_fit

    # the official rounding puts the second-to-last of 93 windows past the end of 2,284 points (CO2's length)
    size, stride = balanced_windows(2284, 93, 0.25)
    assert (size, stride) == (33, 25) and 91 * 25 + 33 > 2284 and not windows_fit(2284, 93, 0.25)
    dense = torch.ones(1, 2284, 1, dtype=torch.bool)
    dense[0, ::40] = False  # density 0.975: about 93 windows wanted
    k = auto_window_count(2284, dense, 0.25)
    assert windows_fit(2284, k, 0.25) and abs(k - 93) <= 2
    missing = torch.zeros(2, 2284, dtype=torch.bool)
    missing[1, 100:400] = True  # row 1 cannot keep 97 windows; no count that runs past the grid is chosen
    counts = merged_window_counts(missing, 97, 0.25).tolist()
    assert counts[0] == 97 and counts[1] < 97 and windows_fit(2284, counts[1], 0.25)
    t = torch.arange(300, dtype=torch.float64)
    bad = next(k for k in range(2, 300) if not windows_fit(300, k, 0.25))
    with pytest.raises(FIMInputError, match=f"windows={bad} on 300 time points: the balanced windows"):
        model.impute(t, torch.sin(t)[None, :, None], torch.ones(1, 300, 1, dtype=torch.bool), t, windows=bad)
