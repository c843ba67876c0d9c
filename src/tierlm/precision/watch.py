"""Watching the fp8 numbers, once per optimizer step.

For every fp8 tensor (each fp8 layer's input, weight and output gradient) the step record gets
its amax, the scale last used, and the fractions of values that underflowed to zero or
saturated. A layer whose tensors keep saturating (more than `fp8_overflow_fraction` of their
values, `fp8_overflow_steps` steps in a row) is switched to bf16, and the switch is logged. A
non-finite amax or scale stops the run: every later cast of that tensor would be garbage.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tierlm.config import PrecisionConfig
from tierlm.precision.linear import Bf16Linear, Fp8Linear, PrecisionLinear


class Fp8ScaleError(RuntimeError):
    """An fp8 scale became non-finite; the message names the layer and what to try."""


def _round(x: float) -> float:
    return float(f"{x:.4g}") if math.isfinite(x) else x


class NoFp8Watch:
    """No fp8 layers in this run: nothing to watch."""

    layers: dict[str, PrecisionLinear] = {}

    def end_step(self, step: int) -> dict[str, Any]:
        return {}

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        yield

    def attach(self, stepper: Any) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Fp8Watch:
    def __init__(
        self, layers: dict[str, PrecisionLinear], cfg: PrecisionConfig,
        log: Callable[[str], None] = print,
    ) -> None:
        self.layers = layers  # fp8 layers still computing in fp8, by module name
        self.overflow_steps = cfg.fp8_overflow_steps
        self.overflow_fraction = cfg.fp8_overflow_fraction
        self.scaling = cfg.fp8_scaling
        self.log = log
        self.streak: dict[str, int] = dict.fromkeys(layers, 0)
        self.rates: dict[str, tuple[float, float]] = {}
        self.switched: list[str] = []

    def _scalers(self):
        for name, mod in self.layers.items():
            yield from ((name, s) for s in mod.compute.scalers.all())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Evaluation and sampling: cast as usual, but record nothing (held-out data must not
        move delayed scales or count as training-step statistics)."""
        scalers = [s for _, s in self._scalers()]
        for s in scalers:
            s.recording = False
        try:
            yield
        finally:
            for s in scalers:
                s.recording = True

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to cast as the uninterrupted one would (JSON, for the
        checkpoint's state.json): the layers switched to bf16, each layer's overflow streak, and
        each tensor's delayed-scaling amax history (newest first; fp32 values, exact in JSON)."""
        return {
            "switched": list(self.switched),
            "streak": dict(self.streak),
            "history": {s.name: s.history.tolist() for _, s in self._scalers()
                        if s.history is not None},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for layer in state.get("switched", []):
            if layer in self.layers:
                self._to_bf16(layer)
                self.log(f"fp8: {layer} stays in bf16 (switched before the checkpoint)")
        self.streak.update({k: v for k, v in state.get("streak", {}).items() if k in self.streak})
        history = state.get("history", {})
        for _, s in self._scalers():
            if s.name in history:
                s.history = torch.tensor(history[s.name], dtype=torch.float32)

    def attach(self, stepper: Any) -> None:
        """The monitor's fp8 probe reads `stepper.fp8_stats()` (tierlm.monitor.probes)."""
        stepper.fp8_stats = self.layer_rates

    def layer_rates(self) -> dict[str, tuple[float, float]]:
        """{layer: (underflow fraction, overflow fraction)} of the last step, over the values
        of its three tensors."""
        return dict(self.rates)

    def end_step(self, step: int) -> dict[str, Any]:
        """Collect the step's statistics (one device sync), switch persistently overflowing
        layers to bf16, and stop on a non-finite scale. Returns fields for the step record."""
        done = [(layer, s, s.end_step()) for layer, s in self._scalers()]
        done = [(layer, s, r) for layer, s, r in done if r is not None]
        if not done:
            return {"fp8_tensors": {}, "fp8_switched": []}
        values = torch.stack([r[0] for _, _, r in done]).tolist()  # (tensors, 4)
        tensors: dict[str, dict[str, float]] = {}
        per_layer: dict[str, list[float]] = {}  # underflowed, overflowed, count, worst overflow
        for (layer, s, (_, count)), (amax, scale, under, over) in zip(done, values, strict=True):
            if not (math.isfinite(amax) and math.isfinite(scale) and scale > 0):
                raise Fp8ScaleError(self._non_finite(step, s.name, amax, scale))
            tensors[s.name] = {"amax": _round(amax), "scale": scale,  # exact
                               "underflow": _round(under / count), "overflow": _round(over / count)}
            acc = per_layer.setdefault(layer, [0.0, 0.0, 0, 0.0])
            acc[0] += under
            acc[1] += over
            acc[2] += count
            acc[3] = max(acc[3], over / count)
        self.rates = {k: (u / n, o / n) for k, (u, o, n, _) in per_layer.items()}
        switched = []
        for layer, (_, _, _, worst) in per_layer.items():
            self.streak[layer] = self.streak[layer] + 1 if worst > self.overflow_fraction else 0
            if self.overflow_steps and self.streak[layer] >= self.overflow_steps:
                switched.append(layer)
        for layer in switched:
            self._switch_to_bf16(layer, step, per_layer[layer][3])
        return {"fp8_tensors": tensors, "fp8_switched": switched}

    def _to_bf16(self, layer: str) -> None:
        mod = self.layers.pop(layer)
        assert isinstance(mod.compute, Fp8Linear)
        mod.compute = Bf16Linear()
        self.switched.append(layer)

    def _switch_to_bf16(self, layer: str, step: int, overflow: float) -> None:
        self._to_bf16(layer)
        self.log(
            f"fp8: {layer} switched to bf16 at step {step}: its fp8 tensors saturated for "
            f"{self.overflow_steps} steps in a row (last step: {overflow:.2%} of values; "
            f"--fp8-scaling {self.scaling})"
        )

    def _non_finite(self, step: int, tensor: str, amax: float, scale: float) -> str:
        hint = (
            "check the data of this step (--data) and the learning rate"
            if self.scaling == "fixed"
            else "try --fp8-scaling fixed (a given scale instead of a measured one), or check "
            "the data of this step (--data) and the learning rate"
        )
        return (
            f"fp8 scale of {tensor} is not finite at step {step} (amax {amax}, scale {scale}): "
            f"the values reaching this layer are inf or NaN. Stopping: {hint}; --bf16-layers "
            f"can keep this layer out of fp8. Continue with --resume RUN_DIR."
        )
