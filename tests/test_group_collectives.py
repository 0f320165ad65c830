"""The autograd collectives over an explicit `group=`: they act within that group alone (forward
and backward), so other parallelisms (context, experts) can reuse them over their own ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.testing import run_ranks


def within_pairs(rank, world):
    from megalite import parallel

    parallel.initialize_model_parallel(world)  # the TP group is all four ranks
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    x = torch.full((4, 2), float(rank + 1), requires_grad=True)
    summed = parallel.reduce_from_tensor_model_parallel_region(x.clone(), group=pair)
    gathered = parallel.gather_from_tensor_model_parallel_region(x, group=pair)
    gathered.backward(torch.ones_like(gathered))
    over_tp = parallel.reduce_from_tensor_model_parallel_region(x.detach().clone())
    sequence = parallel.gather_from_sequence_parallel_region(x.detach(), group=pair)
    return summed[0, 0].item(), gathered.shape, x.grad.shape, over_tp[0, 0].item(), sequence[:, 0].tolist()


def test_collectives_stay_within_the_group_they_are_given():
    results = run_ranks(within_pairs, 4)
    for rank, (summed, gathered, grad, over_tp, sequence) in enumerate(results):
        first = 2 * (rank // 2) + 1  # the pair's ranks hold first and first + 1
        assert summed == first + first + 1, "summed over the pair only"
        assert tuple(gathered) == (4, 4) and tuple(grad) == (4, 2)
        assert over_tp == 1 + 2 + 3 + 4, "no group: the tensor-parallel group"
        assert sequence == [first] * 4 + [first + 1] * 4
