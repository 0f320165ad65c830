"""Loss scaling for fp16: constant (bf16/fp32: 1) or dynamic with growth and hysteresis."""
from __future__ import annotations


class ConstantLossScaler:
    needs_found_inf = False  # nothing to adjust: the optimizer never reads the overflow flag for it

    def __init__(self, scale: float = 1.0):
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]


class DynamicLossScaler:
    """Multiply the loss by `scale` so small fp16 gradients do not flush to zero.

    On a step with inf/NaN gradients the step is skipped; after `hysteresis` such steps (not
    necessarily consecutive since the last growth) the scale is multiplied by `backoff`, never below
    `min_scale`. After `growth_interval` clean steps in a row it is multiplied by `growth`.
    """

    needs_found_inf = True  # the scale changes with overflows, read on the host (one sync a step)

    def __init__(self, initial_scale: float = 2.0 ** 16, growth_interval: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0, growth: float = 2.0, backoff: float = 0.5):
        if initial_scale <= 0 or min_scale <= 0 or growth_interval < 1 or hysteresis < 1:
            raise ValueError("loss scaler: scales must be > 0, growth interval and hysteresis >= 1")
        self.scale, self.min_scale = float(initial_scale), float(min_scale)
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth, self.backoff = growth, backoff
        self._clean_steps, self._hysteresis_left = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
                self._hysteresis_left = self.hysteresis
            return
        self._clean_steps += 1
        if self._clean_steps == self.growth_interval:
            self.scale *= self.growth
            self._clean_steps, self._hysteresis_left = 0, self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._clean_steps = state["scale"], state["clean_steps"]
        self._hysteresis_left = state["hysteresis_left"]
