"""The tiny DeepSeek-V3-shaped model (`--model deepseek-tiny`: MLA with and without a query low rank,
a sigmoid router with aux-loss-free expert bias and the sequence-wise aux loss, group-limited top-k,
a shared expert, the first layer dense, one multi-token prediction module) trains 3 iterations to
one device's losses (main and MTP, within 1e-5) at TP 2 with SP, EP 2, PP 2, CP 2 and (TP 2 with SP, PP 2,
EP 2), each with ZeRO-1 or ZeRO-3; both variants cover every layout and both stages."""
import pytest

from megalite.testing import run_ranks

BASE = ["--model", "deepseek-tiny", "--seq-length", "32", "--train-iters", "3", "--lr", "1e-3",
        "--log-interval", "1", "--global-batch-size", "8", "--micro-batch-size", "2", "--eval-interval", "0"]
VARIANTS = {"plain-q": BASE, "q-lora": BASE + ["--q-lora-rank", "24"]}
# Three layers over two stages: the dense one first, the MoE ones (and the MTP module) last.
PP2 = ["--pp", "2", "--pipeline-layers", "1,2"]
FOUR_RANKS = [["--tp", "2", "--sequence-parallel"], ["--ep", "2"], PP2, ["--cp", "2"]]


def _losses(rank, world, argv):
    from training_ranks import gpt_run
    return [(r["loss"], r["mtp_1_loss"]) for r in gpt_run(argv).records]


def _zero(i: int, variant: str) -> list[str]:
    """ZeRO-1 and ZeRO-3 alternate over the layouts, the other way round for the other variant."""
    return ["--zero-stage", "1" if (i + (variant == "q-lora")) % 2 == 0 else "3"]


def _assert_close(got, want, what):
    assert len(got) == len(want) == 3, (what, got)
    err = max(abs(a - b) / abs(b) for g, w in zip(got, want) for a, b in zip(g, w))
    assert err <= 1e-5, (what, err, got, want)


@pytest.mark.slow
def test_deepseek_tiny_trains_to_one_devices_losses_at_every_layout():
    from training_ranks import several

    names = list(VARIANTS)
    one = run_ranks(several, 1, args=(_losses, [VARIANTS[n] for n in names]))[0]
    four = [(n, i, VARIANTS[n] + layout + _zero(i, n)) for n in names for i, layout in enumerate(FOUR_RANKS)]
    runs = run_ranks(several, 4, args=(_losses, [argv for _, _, argv in four]), timeout=900)
    for k, (name, i, argv) in enumerate(four):
        got = runs[-1][k] if "--pp" in argv else runs[0][k]  # the last stage logs the losses
        _assert_close(got, one[names.index(name)], argv)
    eight = [VARIANTS[n] + ["--tp", "2", "--sequence-parallel", "--ep", "2"] + PP2 + _zero(0, n) for n in names]
    runs = run_ranks(several, 8, args=(_losses, eight), timeout=900)
    for j, argv in enumerate(eight):
        _assert_close(runs[-1][j], one[j], argv)
