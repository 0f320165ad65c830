"""Buffer alignment: every parameter, its main_grad and its fp32 master start at a multiple of 64
elements (16-byte aligned addresses), and DP shards split buckets into equal aligned pieces."""
import pytest
import torch

from megalite import parallel
from megalite.models import BERTModel, GPTModel, TransformerConfig
from megalite.optim import MegaliteOptimizer, ParamAndGradBuffer
from megalite.optim.buffers import ALIGN_NUMEL, plan_layout
from megalite.testing import run_ranks

# Odd sizes on purpose: hidden 40, vocab 50 and 3 positions' worth make parameter sizes that are not
# multiples of 64, so an unaligned layout shows at once.
CONFIG = dict(num_layers=2, hidden_size=40, num_attention_heads=4, vocab_size=50, max_position_embeddings=12,
              hidden_dropout=0.0, attention_dropout=0.0)


def _model(kind):
    config = TransformerConfig(**CONFIG)
    return GPTModel(config, seed=0) if kind == "gpt" else BERTModel(config, seed=0)


def _misaligned(buf, opt):
    """Names of tensors (param, main_grad, master, master grad) that start unaligned."""
    bad = []
    for p in buf.params:
        offset = buf.param_range(p)[0]
        if offset % ALIGN_NUMEL:
            bad.append(f"offset {offset}")
        for what, t in (("param", p), ("main_grad", p.main_grad)):
            if t.data_ptr() % 16:
                bad.append(f"{what} at {offset}")
    for piece in opt.pieces:
        if (piece.lo - piece.buffer.param_range(piece.param)[0]) and piece.lo % ALIGN_NUMEL:
            bad.append(f"piece at {piece.lo}")
        for what, t in (("master", piece.master), ("master grad", piece.master.grad)):
            if t is not None and t.data_ptr() % 16:
                bad.append(f"{what} at {piece.lo}")
    return bad


def _layouts_at_every_dp(rank, world, kind, dtype, distributed):
    parallel.initialize_model_parallel(1)
    problems = {}
    for dp in range(1, 9):
        for dp_rank in range(dp) if distributed else [0]:
            model = _model(kind)
            buf = ParamAndGradBuffer(list(model.parameters()), param_dtype=dtype, grad_dtype=torch.float32,
                                     bucket_numel=3000, dp_group=None, dp_size=dp, dp_rank=dp_rank,
                                     reduce_scatter=distributed)
            opt = MegaliteOptimizer([buf], lr=1e-3, distributed=distributed)
            opt._attach_grads()
            bad = _misaligned(buf, opt)
            if bad:
                problems[(dp, dp_rank)] = bad[:3]
    return problems


@pytest.mark.parametrize("kind", ["gpt", "bert"])
@pytest.mark.parametrize("dtype,distributed", [(torch.float32, False), (torch.bfloat16, True)],
                         ids=["fp32-plain", "bf16-distributed"])
def test_every_param_grad_and_master_starts_16_byte_aligned_at_dp_1_to_8(kind, dtype, distributed):
    problems = run_ranks(_layouts_at_every_dp, 1, args=(kind, dtype, distributed))[0]
    assert not problems, f"{kind}: misaligned at (dp, dp_rank): {problems}"


@pytest.mark.parametrize("dp", range(1, 9))
def test_buckets_split_into_equal_aligned_shards_and_hold_every_parameter_once(dp):
    sizes = [2, 130, 7, 64, 1, 4096, 33, 5]  # deferred: index 3 (a tied embedding alone)
    params = [(n, k == 3) for k, n in enumerate(sizes)]
    layout = plan_layout(params, bucket_numel=150, dp_size=dp)
    assert sorted(k for b in layout for k in b.members) == list(range(len(sizes)))
    assert [b.members for b in layout if b.deferred] == [(3,)]
    end = 0
    for b in layout:
        assert b.start == end, "buckets are contiguous"
        end = b.end
        assert (b.end - b.start) % (ALIGN_NUMEL * dp) == 0, "each DP shard a multiple of 64 elements"
        for k, (lo, hi) in zip(b.members, b.ranges):
            assert lo % ALIGN_NUMEL == 0 and hi - lo == sizes[k] and b.start <= lo and hi <= b.end
        assert sum(b.owned_numel(dp, r) for r in range(dp)) == b.real_numel == sum(sizes[k] for k in b.members)
    ranges = sorted(r for b in layout for r in b.ranges)
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), "no two parameters overlap"
