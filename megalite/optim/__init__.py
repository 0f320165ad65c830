"""Gradient buffers with overlapped DP reduction, the (distributed) mixed-precision optimizer,
loss scaling, learning-rate schedules and local SGD's outer loop."""
from megalite.optim.buffers import ParamAndGradBuffer
from megalite.optim.grads import allreduce_sequence_parallel_grads, counts_once, finalize_grads
from megalite.optim.local_sgd import LocalSGD
from megalite.optim.loss_scaler import ConstantLossScaler, DynamicLossScaler
from megalite.optim.lr import LRSchedule, WeightDecaySchedule
from megalite.optim.optimizer import MegaliteOptimizer

__all__ = [
    "ConstantLossScaler", "DynamicLossScaler", "LRSchedule", "LocalSGD", "MegaliteOptimizer", "ParamAndGradBuffer",
    "WeightDecaySchedule", "allreduce_sequence_parallel_grads", "counts_once", "finalize_grads",
]
