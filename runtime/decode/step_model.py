"""A step model of a split pod you can check (`xpod decode --attention-dies ...`, `xpod bench
engine --attention-dies ... --domains 1,2,3`): per-die costs as functions of the phase inputs,
composed into a step time, printed against the measured step for every shape.

Per decode step, from the measured phase times and CPU of every die (`runtime.decode.split`
`phase_times`):

    attention die:   c_att = a_b * b + a_ctx * b * ctx + a_call * calls
                     (b rows, ctx their mean context, calls = MoE layers x m A2E + E2A pairs)
    trampoline:      c_tr  = t_row * rows + t_call * calls  (rows served, calls = layers x D x m)
    other expert:    c_ex  = x_row * rows + x_call * calls

    step = (sum of c over the dies) / min(cores, dies)

The costs are CPU per step, each die's busy phases (attention, gate, FFN, experts, the A2E /
E2A work) plus what its waits cost: on 2 cores every die's wait yields to the others, and a
trampoline, whose E2A' waits are many and short, pays a large share of a core for them. The
composition is the one of a machine whose cores are always busy (here: 4-8 dies on 2 cores);
on a machine with a core per die the step would be the critical path instead (001 §7.1:
attention, A2E, experts, E2A per micro-batch, overlapped across domains), which this machine
cannot measure.

`fit` takes the costs by least squares (non-negative) from measured shapes; `check` fits on a
run and composes it (the composition's error); `leave_one_out` predicts each shape from the
others (the model's error on shapes it did not see).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROLES = ("attention", "trampoline", "expert")


def samples(ph: dict) -> list[tuple[str, list[float], float]]:
    """(role, features, CPU us per step) of every die of one measured shape."""
    n_att, moe = ph["attention_dies"], ph["moe_layers"]
    m, d = ph["microbatches"], ph["domains"]
    out = []
    for b, ctx, cpu in zip(ph["att_rows"], ph["att_ctx"], ph["att_cpu_us"], strict=True):
        out.append(("attention", [b, b * ctx, moe * m], cpu))
    for j, (rows, cpu) in enumerate(zip(ph["exp_rows"], ph["exp_cpu_us"], strict=True)):
        role = "trampoline" if j < n_att else "expert"  # expert die i's partner: attention i
        out.append((role, [rows, moe * d * m], cpu))
    return out


@dataclass
class StepModel:
    """Costs per role (us per unit; see the module docstring)."""

    coef: dict

    @classmethod
    def fit(cls, shapes: list[dict]) -> StepModel:
        coef = {}
        rows = [s for ph in shapes for s in samples(ph)]
        for role in ROLES:
            xs = np.array([f for r, f, _ in rows if r == role], np.float64)
            ys = np.array([c for r, _, c in rows if r == role], np.float64)
            if not len(xs):
                continue
            coef[role] = _nnls(xs, ys).tolist()
        return cls(coef)

    def die_costs(self, ph: dict) -> list[float]:
        return [float(np.dot(self.coef.get(r, [0.0] * len(f)), f)) for r, f, _ in samples(ph)]

    def predict_ms(self, ph: dict) -> float:
        dies = ph["attention_dies"] + ph["expert_dies"]
        return sum(self.die_costs(ph)) / min(ph["cores"], dies) / 1e3


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (active set, small problems)."""
    keep = list(range(x.shape[1]))
    while keep:
        c, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (c >= 0).all():
            out = np.zeros(x.shape[1])
            out[keep] = c
            return out
        keep.pop(int(np.argmin(c)))
    return np.zeros(x.shape[1])


def check(ph: dict) -> dict:
    """The model fitted on one run and composed: predicted against measured mean step."""
    model = StepModel.fit([ph])
    pred, meas = model.predict_ms(ph), ph["step_mean_ms"]
    return {"step_model_ms": pred, "step_measured_ms": meas,
            "model_error": abs(pred - meas) / meas if meas else 0.0,
            "model_coef": model.coef}  # fmt: skip


def leave_one_out(shapes: list[dict]) -> list[dict]:
    """Each shape predicted by the model fitted on the other shapes (all of them if only one)."""
    out = []
    for i, ph in enumerate(shapes):
        rest = [s for j, s in enumerate(shapes) if j != i] or [ph]
        model = StepModel.fit(rest)
        pred, meas = model.predict_ms(ph), ph["step_mean_ms"]
        out.append({"step_model_ms": pred, "step_measured_ms": meas,
                    "model_error": abs(pred - meas) / meas if meas else 0.0})  # fmt: skip
    return out


__all__ = ["ROLES", "StepModel", "check", "leave_one_out", "samples"]
