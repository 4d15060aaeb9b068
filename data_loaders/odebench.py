"""ODEBench (d'Ascoli et al. 2024, ODEFormer): the 63 published ODE systems (1-4 D) with their
constants and two initial conditions each, transcribed by hand from the published list and checked
against ODEFormer's stored trajectories (agreement to 2.5e-3 relative over [0, 10], the chaotic
Lorenz/Chen-Lee runs excepted, which diverge after t = 2.5-7.7 as chaos does); plus the classic
demo systems (Lorenz, Van der Pol, Lotka-Volterra) and :func:`simulate`.

Each system is ``{"id", "name", "dim", "f": f(x, consts) -> dx/dt, "consts", "inits"}``; the
published time span is [0, 10].
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

__all__ = ["ODEBENCH", "DEMO_SYSTEMS", "simulate"]


def _sys(id_, name, dim, fn, consts, inits):
    return {"id": id_, "name": name, "dim": dim, "f": fn, "consts": consts, "inits": inits}


ODEBENCH: list[dict[str, Any]] = [
    _sys(1, "RC-circuit (charging capacitor)", 1, lambda x, c: [(c[0] - x[0] / c[1]) / c[2]], [0.7, 1.2, 2.31], [[10.0], [3.54]]),
    _sys(2, "Population growth (naive)", 1, lambda x, c: [c[0] * x[0]], [0.23], [[4.78], [0.87]]),
    _sys(3, "Population growth with carrying capacity", 1, lambda x, c: [c[0] * x[0] * (1 - x[0] / c[1])], [0.79, 74.3], [[7.3], [21.0]]),
    _sys(4, "RC-circuit with non-linear resistor", 1, lambda x, c: [1 / (1 + np.exp(c[0] - x[0] / c[1])) - 0.5], [0.5, 0.96], [[0.8], [0.02]]),
    _sys(5, "Falling object with air resistance", 1, lambda x, c: [c[0] - c[1] * x[0] ** 2], [9.81, 0.0021175], [[0.5], [73.0]]),
    _sys(6, "Autocatalysis with one fixed abundant chemical", 1, lambda x, c: [c[0] * x[0] - c[1] * x[0] ** 2], [2.1, 0.5], [[0.13], [2.24]]),
    _sys(7, "Gompertz law for tumor growth", 1, lambda x, c: [c[0] * x[0] * np.log(c[1] * x[0])], [0.032, 2.29], [[1.73], [9.5]]),
    _sys(8, "Logistic equation with Allee effect", 1, lambda x, c: [c[0] * x[0] * (1 - x[0] / c[1]) * (x[0] / c[2] - 1)], [0.14, 130.0, 4.4], [[6.123], [2.1]]),
    _sys(9, "Language death model", 1, lambda x, c: [(1 - x[0]) * c[0] - x[0] * c[1]], [0.32, 0.28], [[0.14], [0.55]]),
    _sys(10, "Refined language death model", 1, lambda x, c: [(1 - x[0]) * c[0] * x[0] ** c[1] - x[0] * (1 - c[0]) * (1 - x[0]) ** c[1]], [0.2, 1.2], [[0.83], [0.34]]),
    _sys(11, "Naive critical slowing down", 1, lambda x, c: [-x[0] ** 3], [], [[3.4], [1.6]]),
    _sys(12, "Photons in a laser (simple)", 1, lambda x, c: [c[0] * x[0] - c[1] * x[0] ** 2], [1.8, 0.1107], [[11.0], [1.3]]),
    _sys(13, "Overdamped bead on a rotating hoop", 1, lambda x, c: [c[0] * np.sin(x[0]) * (c[1] * np.cos(x[0]) - 1)], [0.0981, 9.7], [[3.1], [2.4]]),
    _sys(14, "Budworm outbreak model with predation", 1, lambda x, c: [c[0] * x[0] * (1 - x[0] / c[1]) - c[3] * x[0] ** 2 / (c[2] ** 2 + x[0] ** 2)], [0.78, 81.0, 21.2, 0.9], [[2.76], [23.3]]),
    _sys(15, "Budworm outbreak (dimensionless)", 1, lambda x, c: [c[0] * x[0] * (1 - x[0] / c[1]) - x[0] ** 2 / (1 + x[0] ** 2)], [0.4, 95.0], [[44.3], [4.5]]),
    _sys(16, "Landau equation", 1, lambda x, c: [c[0] * x[0] - c[1] * x[0] ** 3 - c[2] * x[0] ** 5], [0.1, -0.04, 0.001], [[0.94], [1.65]]),
    _sys(17, "Logistic equation with harvesting", 1, lambda x, c: [c[0] * x[0] * (1 - x[0] / c[1]) - c[2]], [0.4, 100.0, 0.3], [[14.3], [34.2]]),
    _sys(18, "Improved logistic equation with harvesting", 1, lambda x, c: [c[0] * x[0] * (1 - x[0] / c[1]) - c[2] * x[0] / (c[3] + x[0])], [0.4, 100.0, 0.24, 50.0], [[21.1], [44.1]]),
    _sys(19, "Improved logistic with harvesting (dimensionless)", 1, lambda x, c: [x[0] * (1 - x[0]) - c[0] * x[0] / (c[1] + x[0])], [0.08, 0.8], [[0.13], [0.03]]),
    _sys(20, "Autocatalytic gene switching", 1, lambda x, c: [c[0] - c[1] * x[0] + x[0] ** 2 / (1 + x[0] ** 2)], [0.1, 0.55], [[0.002], [0.25]]),
    _sys(21, "Reduced SIR model for dead people", 1, lambda x, c: [c[0] - c[1] * x[0] - np.exp(-x[0])], [1.2, 0.2], [[0.0], [0.8]]),
    _sys(22, "Hysteretic activation of protein expression", 1, lambda x, c: [c[0] + c[1] * x[0] ** 5 / (c[2] + x[0] ** 5) - c[3] * x[0]], [1.4, 0.4, 123.0, 0.89], [[3.1], [6.3]]),
    _sys(23, "Overdamped pendulum with constant torque", 1, lambda x, c: [c[0] - np.sin(x[0])], [0.21], [[-2.74], [1.65]]),
    _sys(24, "Harmonic oscillator without damping", 2, lambda x, c: [x[1], -c[0] * x[0]], [2.1], [[0.4, -0.03], [0.0, 0.2]]),
    _sys(25, "Harmonic oscillator with damping", 2, lambda x, c: [x[1], -c[0] * x[0] - c[1] * x[1]], [4.5, 0.43], [[0.12, 0.043], [0.0, -0.3]]),
    _sys(26, "Lotka-Volterra competition (rabbits and sheep)", 2, lambda x, c: [x[0] * (c[0] - x[0] - c[1] * x[1]), x[1] * (c[2] - x[0] - x[1])], [3.0, 2.0, 2.0], [[5.0, 4.3], [2.3, 3.6]]),
    _sys(27, "Lotka-Volterra predator-prey", 2, lambda x, c: [x[0] * (c[0] - c[1] * x[1]), -x[1] * (c[2] - c[3] * x[0])], [1.84, 1.45, 3.0, 1.62], [[8.3, 3.4], [0.4, 0.65]]),
    _sys(28, "Pendulum without friction", 2, lambda x, c: [x[1], -c[0] * np.sin(x[0])], [0.9], [[-1.9, 0.0], [0.3, 0.8]]),
    _sys(29, "Dipole fixed point", 2, lambda x, c: [c[0] * x[0] * x[1], x[1] ** 2 - x[0] ** 2], [0.65], [[3.2, 1.4], [1.3, 0.2]]),
    _sys(30, "RNA molecules catalyzing each other", 2, lambda x, c: [x[0] * (x[1] - c[0] * x[0] * x[1]), x[1] * (x[0] - c[0] * x[0] * x[1])], [1.61], [[0.3, 0.04], [0.1, 0.21]]),
    _sys(31, "SIR infection model (only infected and susceptible)", 2, lambda x, c: [-c[0] * x[0] * x[1], c[0] * x[0] * x[1] - c[1] * x[1]], [0.4, 0.314], [[7.2, 0.98], [20.0, 12.4]]),
    _sys(32, "Damped double well oscillator", 2, lambda x, c: [x[1], -c[0] * x[1] + x[0] - x[0] ** 3], [0.18], [[-1.8, -1.8], [5.8, 0.0]]),
    _sys(33, "Glider (dimensionless)", 2, lambda x, c: [-np.sin(x[1]) - c[0] * x[0] ** 2, x[0] - np.cos(x[1]) / x[0]], [0.08], [[5.0, 0.7], [9.81, -0.8]]),
    _sys(34, "Frictionless bead on a rotating hoop (dimensionless)", 2, lambda x, c: [x[1], np.sin(x[0]) * (np.cos(x[0]) - c[0])], [0.93], [[2.1, 0.0], [-1.2, -0.2]]),
    _sys(35, "Rotational dynamics of an object in a shear flow", 2, lambda x, c: [np.cos(x[0]) / np.tan(x[1]), np.sin(x[0]) * (np.cos(x[1]) ** 2 + c[0] * np.sin(x[1]) ** 2)], [4.2], [[1.13, -0.3], [2.4, 1.7]]),
    _sys(36, "Pendulum with non-linear damping, no driving", 2, lambda x, c: [x[1], -np.sin(x[0]) - x[1] - c[0] * np.cos(x[0]) * x[1]], [0.07], [[0.45, 0.9], [1.34, -0.8]]),
    _sys(37, "Van der Pol oscillator (standard form)", 2, lambda x, c: [x[1], -x[0] - c[0] * (x[0] ** 2 - 1) * x[1]], [0.43], [[2.2, 0.0], [0.1, 3.2]]),
    _sys(38, "Van der Pol oscillator (simplified form from Strogatz)", 2, lambda x, c: [c[0] * (x[1] - x[0] ** 3 / 3 + x[0]), -x[0] / c[0]], [3.37], [[0.7, 0.0], [-1.1, -0.7]]),
    _sys(39, "Glycolytic oscillator (dimensionless)", 2, lambda x, c: [-x[0] + c[0] * x[1] + x[0] ** 2 * x[1], c[1] - c[0] * x[0] - x[0] ** 2 * x[1]], [2.4, 0.07], [[0.4, 0.31], [0.2, -0.7]]),
    # named "Duffing equation" in the published list; its equation (transcribed as published) is a
    # weakly non-linear van der Pol-type oscillator
    _sys(40, "Duffing equation (weakly non-linear oscillation)", 2, lambda x, c: [x[1], -x[0] + c[0] * x[1] * (1 - x[0] ** 2)], [0.886], [[0.63, -0.03], [0.2, 0.2]]),
    _sys(41, "Cell cycle model (Tyson, cdc2 and cyclin)", 2, lambda x, c: [c[0] * (x[1] - x[0]) * (c[1] + x[0] ** 2) - x[0], c[2] - x[0]], [15.3, 0.001, 0.3], [[0.8, 0.3], [0.02, 1.2]]),
    _sys(42, "Chlorine dioxide-iodine-malonic acid reaction (reduced)", 2, lambda x, c: [c[0] - x[0] - c[1] * x[0] * x[1] / (1 + x[0] ** 2), c[2] * x[0] * (1 - x[1] / (1 + x[0] ** 2))], [8.9, 4.0, 1.4], [[0.2, 0.35], [3.0, 7.8]]),
    _sys(43, "Driven pendulum with linear damping", 2, lambda x, c: [x[1], c[0] - np.sin(x[0]) - c[1] * x[1]], [1.67, 0.64], [[1.47, -0.2], [-1.9, 0.03]]),
    _sys(44, "Driven pendulum with quadratic damping", 2, lambda x, c: [x[1], c[0] - np.sin(x[0]) - c[1] * x[1] * np.abs(x[1])], [1.67, 0.64], [[1.47, -0.2], [-1.9, 0.03]]),
    _sys(45, "Isothermal autocatalytic reaction (Gray-Scott 1985)", 2, lambda x, c: [c[0] * (1 - x[0]) - x[0] * x[1] ** 2, x[0] * x[1] ** 2 - c[1] * x[1]], [0.5, 0.02], [[1.4, 0.2], [0.32, 0.64]]),
    _sys(46, "Interacting bar magnets", 2, lambda x, c: [c[0] * np.sin(x[0] - x[1]) - np.sin(x[0]), c[0] * np.sin(x[1] - x[0]) - np.sin(x[1])], [0.33], [[0.54, -0.1], [0.43, 1.21]]),
    _sys(47, "Binocular rivalry model (no oscillations)", 2, lambda x, c: [-x[0] + 1 / (1 + np.exp(c[0] * x[1] - c[1])), -x[1] + 1 / (1 + np.exp(c[0] * x[0] - c[1]))], [4.89, 1.4], [[0.65, 0.59], [3.2, 10.3]]),
    _sys(48, "Bacterial respiration (nutrients and oxygen)", 2, lambda x, c: [c[0] - x[0] - x[0] * x[1] / (1 + c[1] * x[0] ** 2), c[2] - x[0] * x[1] / (1 + c[1] * x[0] ** 2)], [18.3, 0.48, 11.23], [[0.1, 30.4], [13.2, 5.21]]),
    _sys(49, "Brusselator (dimensionless)", 2, lambda x, c: [1 - (c[0] + 1) * x[0] + c[1] * x[0] ** 2 * x[1], c[0] * x[0] - c[1] * x[0] ** 2 * x[1]], [3.03, 3.1], [[0.7, -1.4], [2.1, 1.3]]),
    _sys(50, "Chemical oscillator (Schnackenberg 1979)", 2, lambda x, c: [c[0] - x[0] + x[0] ** 2 * x[1], c[1] - x[0] ** 2 * x[1]], [0.24, 1.43], [[0.14, 0.6], [1.5, 0.9]]),
    _sys(51, "Oscillator death model (Ermentrout-Kopell 1990)", 2, lambda x, c: [c[0] + np.sin(x[1]) * np.cos(x[0]), c[1] + np.sin(x[1]) * np.cos(x[0])], [1.432, 0.972], [[2.2, 0.67], [0.03, -0.12]]),
    _sys(52, "Maxwell-Bloch equations (laser dynamics)", 3, lambda x, c: [c[0] * (x[1] - x[0]), c[1] * (x[0] * x[2] - x[1]), c[2] * (c[3] + 1 - x[2] - c[3] * x[0] * x[1])], [0.1, 0.21, 0.34, 3.1], [[1.3, 1.1, 0.89], [0.89, 1.3, 1.1]]),
    _sys(53, "Apoptosis (cell death) model", 3, lambda x, c: [
        c[0] - c[5] * x[1] * x[0] / (c[9] + x[0]) - c[4] * x[0],
        c[1] * x[2] * (c[8] + x[1]) - c[2] * x[1] / (c[6] + x[1]) - c[3] * x[0] * x[1] / (c[7] + x[1]),
        -c[1] * x[2] * (c[8] + x[1]) + c[2] * x[1] / (c[6] + x[1]) + c[3] * x[0] * x[1] / (c[7] + x[1])],
        [0.1, 0.6, 0.2, 7.95, 0.05, 0.4, 0.1, 2.0, 0.1, 0.1], [[0.005, 0.26, 2.15], [0.248, 0.0973, 0.0027]]),
    _sys(54, "Lorenz equations (well-behaved periodic regime)", 3, lambda x, c: [c[0] * (x[1] - x[0]), c[1] * x[0] - x[1] - x[0] * x[2], x[0] * x[1] - c[2] * x[2]], [5.1, 12.0, 1.67], [[2.3, 8.1, 12.4], [10.0, 20.0, 30.0]]),
    _sys(55, "Lorenz equations (complex periodic regime)", 3, lambda x, c: [c[0] * (x[1] - x[0]), c[1] * x[0] - x[1] - x[0] * x[2], x[0] * x[1] - c[2] * x[2]], [10.0, 99.96, 8.0 / 3.0], [[2.3, 8.1, 12.4], [10.0, 20.0, 30.0]]),
    _sys(56, "Lorenz equations (standard parameters, chaotic)", 3, lambda x, c: [c[0] * (x[1] - x[0]), c[1] * x[0] - x[1] - x[0] * x[2], x[0] * x[1] - c[2] * x[2]], [10.0, 28.0, 8.0 / 3.0], [[2.3, 8.1, 12.4], [10.0, 20.0, 30.0]]),
    _sys(57, "Rössler attractor (stable fixed point)", 3, lambda x, c: [c[3] * (-x[1] - x[2]), c[3] * (x[0] + c[0] * x[1]), c[3] * (c[1] + x[2] * (x[0] - c[2]))], [-0.2, 0.2, 5.7, 5.0], [[2.3, 1.1, 0.8], [-0.1, 4.1, -2.1]]),
    _sys(58, "Rössler attractor (periodic)", 3, lambda x, c: [c[3] * (-x[1] - x[2]), c[3] * (x[0] + c[0] * x[1]), c[3] * (c[1] + x[2] * (x[0] - c[2]))], [0.1, 0.2, 5.7, 5.0], [[2.3, 1.1, 0.8], [-0.1, 4.1, -2.1]]),
    _sys(59, "Rössler attractor (chaotic)", 3, lambda x, c: [c[3] * (-x[1] - x[2]), c[3] * (x[0] + c[0] * x[1]), c[3] * (c[1] + x[2] * (x[0] - c[2]))], [0.2, 0.2, 5.7, 5.0], [[2.3, 1.1, 0.8], [-0.1, 4.1, -2.1]]),
    _sys(60, "Aizawa attractor (chaotic)", 3, lambda x, c: [
        x[0] * (x[2] - c[1]) - c[3] * x[1], c[3] * x[0] + x[1] * (x[2] - c[1]),
        c[2] + c[0] * x[2] - x[2] ** 3 / 3 - (x[0] ** 2 + x[1] ** 2) * (1 + c[4] * x[2]) + c[5] * x[2] * x[0] ** 3],
        [0.95, 0.7, 0.65, 3.5, 0.25, 0.1], [[0.1, 0.05, 0.05], [-0.3, 0.2, 0.1]]),
    _sys(61, "Chen-Lee attractor (gyro motion with feedback control, chaotic)", 3, lambda x, c: [c[0] * x[0] - x[1] * x[2], c[1] * x[1] + x[0] * x[2], c[2] * x[2] + x[0] * x[1] / c[3]], [5.0, -10.0, -3.8, 3.0], [[15.0, -15.0, -15.0], [8.0, 14.0, -10.0]]),
    _sys(62, "Binocular rivalry model with adaptation (oscillations)", 4, lambda x, c: [
        -x[0] + 1 / (1 + np.exp(c[0] * x[2] + c[1] * x[1] - c[2])), c[3] * (x[0] - x[1]),
        -x[2] + 1 / (1 + np.exp(c[0] * x[0] + c[1] * x[3] - c[2])), c[3] * (x[2] - x[3])],
        [0.89, 0.4, 1.4, 1.0], [[2.25, -0.5, -1.13, 0.4], [0.342, -0.431, -0.86, 0.041]]),
    _sys(63, "SEIR infection model (proportions)", 4, lambda x, c: [-c[1] * x[0] * x[2], c[1] * x[0] * x[2] - c[0] * x[1], c[0] * x[1] - c[2] * x[2], c[2] * x[2]], [0.47, 0.28, 0.3], [[0.6, 0.3, 0.09, 0.01], [0.4, 0.3, 0.25, 0.05]]),
]

#: the demo systems (classic parameters)
DEMO_SYSTEMS = {
    "lorenz": (lambda x, c: [10 * (x[1] - x[0]), x[0] * (28 - x[2]) - x[1], x[0] * x[1] - 8 / 3 * x[2]], [1.0, 1.0, 1.0], 2.0),
    "van_der_pol": (lambda x, c: [x[1], 1.0 * (1 - x[0] ** 2) * x[1] - x[0]], [2.0, 0.0], 20.0),
    "lotka_volterra": (lambda x, c: [1.1 * x[0] - 0.4 * x[0] * x[1], 0.1 * x[0] * x[1] - 0.4 * x[1]], [10.0, 5.0], 30.0),
}


def simulate(fn: Callable, consts, init, t_end: float = 10.0, n_points: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """``(times (T,), values (T, D))`` of ``dx/dt = fn(x, consts)`` from ``init`` (scipy LSODA, tight tolerances)."""
    from scipy.integrate import solve_ivp

    times = np.linspace(0.0, t_end, n_points)
    sol = solve_ivp(lambda t, x: fn(x, consts), (0.0, t_end), np.asarray(init, dtype=float), t_eval=times,
                    method="LSODA", rtol=1e-8, atol=1e-10)
    if not sol.success or sol.y.shape[1] != n_points:
        raise RuntimeError(f"simulation failed: {sol.message}")
    return times, sol.y.T
