"""Mixture of experts: router (router.py), token dispatchers (dispatcher.py), grouped experts
(experts.py), load-balancing losses (losses.py) and the layer that joins them (layer.py)."""
from megalite.models.moe.layer import MoELayer

__all__ = ["MoELayer"]
