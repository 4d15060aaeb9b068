"""A **synthetic** cohort of hourly wearable data with health labels (nothing here is real data).

Real hourly behavioural data with health labels is rarely public under a permissive licence, so
the embedded default of the wearables family runs on this simulator. Its labels are functions of
the simulated physiology, which the model never sees directly; it must infer them from behaviour,
as a real probe must. Results on it say that a pipeline works, not how a model does on people.

Generative model (per participant ``i``; days ``d``; hours ``t``; all times local wall-clock):

* Traits: fitness ``f ~ N(0, 1)``; habitual sleep duration ``s ~ N(7.1, 0.8)`` h; chronotype
  (sleep midpoint) ``c ~ N(3.5, 0.8)`` h after midnight; activity level ``a ~ N(0, 0.5)``
  (log scale); shift worker ``w ~ Bernoulli(0.15)``; device-wear compliance ``q ~ Beta(8, 2)``.
* Sleep: on each night the midpoint is ``c + 0.8`` h on weekends (social jet lag) plus ``N(0,
  0.5)`` noise, the duration ``s + 0.6`` h on weekends plus ``N(0, 0.6)``; a shift worker sleeps
  in the day (midpoint ``c + 10`` h) on work days. ``sleep_min`` is the minutes of each hour
  covered; ``in_bed_min`` adds 5-30 min before and 0-20 min after.
* Activity: awake hours carry a circadian baseline (peaks mid-morning and early evening, a
  commute bump on weekdays) times ``exp(a + 0.3 f)``, plus bouts (Poisson 1.2 per day; 20-60 min
  of 80-140 steps/min, more likely for fitter people); steps are Poisson around that rate.
  ``active_kcal = 0.04 * steps * (1 - 0.1 f) + noise``; ``exercise_min`` are bout minutes.
* Heart rate: resting HR ``r = 64 - 5 f + N(0, 3)``; hourly ``heart_rate = r + 0.012 steps
  (1 - 0.25 f) + 3 (awake) - 4 (asleep) + N(0, 2)``; ``resting_hr`` is one daily sample
  ``r + N(0, 1.5)`` at 07:00; ``hrv_sdnn = 45 + 9 f + 5 (asleep) + N(0, 6)`` (sampled every 2-4 h).
* Wear: each day is missing entirely with probability ``1 - q`` (device not worn); otherwise a
  charging gap of 1-3 h in the evening with probability 0.5. Missing hours are NaN in every column.

Labels (participant-level, binary): ``short_sleep`` = habitual duration ``s < 6.5`` h;
``low_fitness`` = ``f < -0.5``; ``shift_work`` = ``w``. Weekly (time-varying):
``short_sleep_week`` = that week's simulated mean sleep below 6.5 h.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

__all__ = ["SYNTHETIC_VARIABLES", "SyntheticCohort", "synthetic_cohort"]

#: the columns the simulator produces (a subset of :data:`domainfm.data_loaders.wearables.VARIABLES`)
SYNTHETIC_VARIABLES = ("steps", "active_kcal", "exercise_min", "heart_rate", "resting_hr", "hrv_sdnn",
                       "sleep_min", "in_bed_min")


@dataclass
class SyntheticCohort:
    """``tables[i]``: participant ``i``'s hourly table (the readers' format); ``labels``: one row per
    participant (``participant``, ``short_sleep``, ``low_fitness``, ``shift_work`` and the traits);
    ``weekly``: one row per participant-week (``participant``, ``week_start``, ``short_sleep_week``)."""

    tables: list[pd.DataFrame]
    labels: pd.DataFrame
    weekly: pd.DataFrame

    PARTICIPANT_TASKS = ("short_sleep", "low_fitness", "shift_work")
    WEEKLY_TASKS = ("short_sleep_week",)


def _coverage(starts: np.ndarray, ends: np.ndarray, n_hours: int) -> np.ndarray:
    """Minutes of each hour ``0..n_hours-1`` covered by intervals given in hours (may overlap the ends)."""
    minutes = np.zeros(n_hours * 60, dtype=bool)
    for s, e in zip(starts, ends):
        a, b = max(int(round(s * 60)), 0), min(int(round(e * 60)), n_hours * 60)
        if b > a:
            minutes[a:b] = True
    return minutes.reshape(n_hours, 60).sum(1).astype(float)


def _participant(rng: np.random.Generator, n_days: int, start: pd.Timestamp):
    f, s, c, a = rng.normal(0, 1), rng.normal(7.1, 0.8), rng.normal(3.5, 0.8), rng.normal(0, 0.5)
    shift = rng.random() < 0.15
    q = rng.beta(8, 2)
    n = n_days * 24
    days = pd.date_range(start, periods=n_days, freq="D")
    weekend = days.weekday >= 5
    # sleep episodes, one per night, placed relative to the start of the day they end in
    mids = c + 0.8 * weekend + rng.normal(0, 0.5, n_days)
    durs = np.clip(s + 0.6 * weekend + rng.normal(0, 0.6, n_days), 3.0, 11.0)
    if shift:
        work = ~weekend & (rng.random(n_days) < 0.8)
        mids = np.where(work, c + 10.0 + rng.normal(0, 0.7, n_days), mids)
    centre = np.arange(n_days) * 24 + mids
    sleep_s, sleep_e = centre - durs / 2, centre + durs / 2
    sleep = _coverage(sleep_s, sleep_e, n)
    in_bed = _coverage(sleep_s - rng.uniform(5, 30, n_days) / 60, sleep_e + rng.uniform(0, 20, n_days) / 60, n)
    asleep = sleep >= 30
    # activity: circadian baseline while awake, weekday commute, bouts
    hour = np.arange(n) % 24
    day = np.arange(n) // 24
    base = 120 * np.exp(-0.5 * ((hour - 10) / 2.5) ** 2) + 150 * np.exp(-0.5 * ((hour - 18) / 2.0) ** 2) + 40
    commute = (~weekend[day]) * (250 * np.exp(-0.5 * ((hour - 8) / 0.7) ** 2) + 200 * np.exp(-0.5 * ((hour - 17.5) / 0.7) ** 2))
    rate = (base + commute * (not shift)) * np.exp(a + 0.3 * f) * (1 - sleep / 60)
    bout_min = np.zeros(n)
    n_bouts = rng.poisson(1.2 * np.exp(0.3 * f), n_days)
    for d_i, k in enumerate(n_bouts):
        for _ in range(k):
            h = d_i * 24 + int(rng.integers(6, 22))
            if h < n and not asleep[h]:
                m = float(rng.uniform(20, 60))
                bout_min[h] += min(m, 60 - bout_min[h])
                rate[h] += m * rng.uniform(80, 140)
    steps = rng.poisson(np.maximum(rate, 0)).astype(float)
    active = np.maximum(0.04 * steps * (1 - 0.1 * f) + rng.normal(0, 2, n), 0)
    r = 64 - 5 * f + rng.normal(0, 3)
    hr = r + 0.012 * steps * (1 - 0.25 * f) + np.where(asleep, -4.0, 3.0) + rng.normal(0, 2, n)
    resting = np.full(n, np.nan)
    resting[np.arange(n_days) * 24 + 7] = r + rng.normal(0, 1.5, n_days)
    hrv = np.full(n, np.nan)
    t = int(rng.integers(0, 3))
    while t < n:
        hrv[t] = 45 + 9 * f + 5 * asleep[t] + rng.normal(0, 6)
        t += int(rng.integers(2, 5))
    table = pd.DataFrame({"steps": steps, "active_kcal": active, "exercise_min": bout_min, "heart_rate": hr,
                          "resting_hr": resting, "hrv_sdnn": hrv, "sleep_min": sleep, "in_bed_min": in_bed},
                         index=pd.DatetimeIndex(pd.date_range(start, periods=n, freq="h"), name="time"))
    # device wear: whole days off, evening charging gaps
    worn = np.ones(n, dtype=bool)
    for d_i in range(n_days):
        if rng.random() > q:
            worn[d_i * 24:(d_i + 1) * 24] = False
        elif rng.random() < 0.5:
            g = d_i * 24 + int(rng.integers(18, 22))
            worn[g:g + int(rng.integers(1, 4))] = False
    table.loc[~worn] = np.nan
    for column in ("steps", "active_kcal", "exercise_min"):
        # a worn device reports 0 steps in a quiet hour; sleep minutes 0 when awake
        table.loc[worn & table[column].isna(), column] = 0.0
    traits = {"fitness": f, "sleep_need_h": s, "chronotype_h": c, "activity": a, "resting_hr_true": r, "wear": q,
              "short_sleep": int(s < 6.5), "low_fitness": int(f < -0.5), "shift_work": int(shift)}
    weekly_sleep = (sleep.reshape(-1, 168).sum(1) / 60 / 7) if n % 168 == 0 else None
    return table, traits, weekly_sleep


def synthetic_cohort(n_participants: int = 200, n_weeks: int = 4, *, seed: int = 0,
                     start: str = "2024-01-01") -> SyntheticCohort:
    """Simulate ``n_participants`` people for ``n_weeks`` weeks from Monday ``start`` (see module docstring)."""
    if n_participants < 1 or n_weeks < 1:
        raise ValueError(f"synthetic_cohort: n_participants={n_participants} and n_weeks={n_weeks} must be >= 1")
    start_ts = pd.Timestamp(start)
    if start_ts.weekday() != 0 or start_ts != start_ts.normalize():
        raise ValueError(f"synthetic_cohort: start={start!r} must be a Monday at 00:00 (weeks start on Mondays)")
    rng = np.random.default_rng(seed)
    tables, rows, weekly = [], [], []
    for i in range(n_participants):
        table, traits, week_sleep = _participant(rng, 7 * n_weeks, start_ts)
        tables.append(table)
        rows.append({"participant": i, **traits})
        for w in range(n_weeks):
            weekly.append({"participant": i, "week_start": start_ts + pd.Timedelta(weeks=w),
                           "sleep_h": float(week_sleep[w]), "short_sleep_week": int(week_sleep[w] < 6.5)})
    return SyntheticCohort(tables, pd.DataFrame(rows), pd.DataFrame(weekly))
