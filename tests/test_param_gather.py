"""--overlap-param-gather (megalite.optim.param_gather): the distributed optimizer's parameter
all-gathers waited for in the next forward, not after the update, with the same numbers.

The ranks' gathers here are lazy: each moves its bytes only when it is waited for, so a parameter
read before its bucket's wait reads the stale shards of the other ranks, whatever the timing. A run
that misses a wait therefore trains differently, every time (the control below shows it does)."""
from __future__ import annotations

import pytest
import torch

from megalite.optim import buffers as buffers_module
from megalite.optim import param_gather
from megalite.testing import run_ranks
from test_moe_training import MOE
from training_ranks import parse, several

BASE = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1",
        "--train-iters", "3", "--eval-interval", "2", "--eval-iters", "1", "--lr", "1e-3"]
FLAG = "--overlap-param-gather"


class _LazyGather:
    """An all-gather that runs when it is waited for (collective: every rank waits in the same order)."""

    def __init__(self, out, shard, group, log):
        self.args, self.log, self.done = (out, shard, group), log, False

    def wait(self):
        if not self.done:
            out, shard, group = self.args
            torch.distributed.all_gather_into_tensor(out, shard.clone(), group=group)
            self.log.append("in the update" if _Phase.updating else "later")
            self.done = True
        return True


class _Phase:
    updating = False


def _lazy_gathers(log):
    def gather(out, shard, group=None, async_op=False):
        log.append("posted in the update" if _Phase.updating else "posted later")
        work = _LazyGather(out, shard, group, log)
        return work if async_op else work.wait()
    buffers_module._all_gather_single = gather
    update = buffers_module.ParamAndGradBuffer.all_gather_params

    def all_gather_params(self):
        _Phase.updating = True
        try:
            update(self)
        finally:
            _Phase.updating = False
    buffers_module.ParamAndGradBuffer.all_gather_params = all_gather_params


def _train(rank, world, argv, skip_waits=False):
    """Losses, final parameters (whole) and where each gather was waited for, with lazy gathers."""
    from megalite.training import pretrain

    import pretrain_bert
    import pretrain_gpt

    log = []
    _lazy_gathers(log)
    if skip_waits:  # the control: the flag's gathers left in flight, no forward waits for them
        param_gather.attach_gather_waits = lambda chunk, buf: setattr(buf, "overlap_param_gather", True)
        import megalite.training.build as build
        build.attach_gather_waits = param_gather.attach_gather_waits
    task = pretrain_bert.task() if "bert-tiny" in argv else pretrain_gpt.task()
    run = pretrain(parse(argv), task)
    with run.optimizer.whole_parameters():
        params = {f"{i}.{n}": p.detach().clone() for i, c in enumerate(run.model_chunks)
                  for n, p in c.named_parameters()}
    return {"losses": [(r.get("loss"), r.get("grad_norm"), r.get("comm_bytes")) for r in run.records],
            "params": params, "waited": {w: log.count(w) for w in set(log)}}


def _pair(rank, world, argv):
    return [_train(rank, world, argv), _train(rank, world, argv + [FLAG])]


# (ranks, flags): each trained with and without the flag in one process group per world size.
CASES = {
    "gpt-dp2-zero1-tied": (2, ["--use-distributed-optimizer"]),
    "gpt-dp2-zero2": (2, ["--zero-stage", "2"]),
    "bert-dp2-zero1": (2, ["--model", "bert-tiny", "--use-distributed-optimizer"]),
    "moe-ep2-pairs-zero1": (2, [*MOE, "--model", "moe-tiny", "--ep", "2", "--use-distributed-optimizer",
                                "--overlap-moe-expert-parallel-comm"]),
    "llama-mtp-dp2-zero1": (2, ["--model", "llama-tiny", "--mtp-num-layers", "1", "--use-distributed-optimizer"]),
    # multi-latent attention, DeepSeek's MoE (shared expert, expert bias): their parts' own waits
    "deepseek-ep2-zero1": (2, ["--model", "deepseek-tiny", "--ep", "2", "--use-distributed-optimizer"]),
    "gpt-pp2-dp2-tied-zero1": (4, ["--pp", "2", "--use-distributed-optimizer"]),
    "gpt-pp2-vpp2-dp2-zero1": (4, ["--pp", "2", "--vpp", "2", "--use-distributed-optimizer"]),
    "llama-tp2-sp-dp2-zero2": (4, ["--model", "llama-tiny", "--tp", "2", "--sequence-parallel", "--zero-stage", "2"]),
    "moe-pp2-ep2-dualpipev-zero1": (4, [*MOE, "--model", "moe-tiny", "--pp", "2", "--ep", "2",
                                        "--pipeline-schedule", "dualpipev", "--global-batch-size", "16",
                                        "--use-distributed-optimizer"]),
}


@pytest.fixture(scope="module")
def trained():
    out = {}
    for world in sorted({w for w, _ in CASES.values()}):
        keys = [k for k, (w, _) in CASES.items() if w == world]
        per_rank = run_ranks(several, world, args=(_pair, [BASE + CASES[k][1] for k in keys]), timeout=900)
        out.update(zip(keys, map(list, zip(*per_rank))))  # key -> [rank 0's pair, rank 1's, ...]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_overlapped_parameter_gathers_train_bitwise_like_gathers_after_the_update(trained, case):
    """Losses, gradient norms and final parameters bitwise; each step's counted bytes the same (a
    gather counts in the step whose update it carries)."""
    for plain, overlapped in trained[case]:
        assert plain["losses"] == overlapped["losses"]
        assert [n for n, p in plain["params"].items() if not torch.equal(p, overlapped["params"][n])] == []
        # Without the flag every gather is posted and waited for in the update; with it, both after
        # (posted as the next step's schedule begins, waited for in its forward).
        n = plain["waited"]["in the update"]
        assert plain["waited"] == {"posted in the update": n, "in the update": n}
        assert overlapped["waited"] == {"posted later": n, "later": n}


def _control(rank, world, argv):
    plain = _train(rank, world, [a for a in argv if a != FLAG])
    return plain, _train(rank, world, argv), _train(rank, world, argv, skip_waits=True)


def test_a_forward_that_does_not_wait_reads_stale_shards():
    """The control: the lazy gathers catch a forward that reads a bucket before its wait."""
    argv = BASE + ["--use-distributed-optimizer", FLAG, "--eval-interval", "0"]
    for plain, waited, skipped in run_ranks(_control, 2, args=(argv,), timeout=300):
        assert plain["losses"] == waited["losses"]
        assert skipped["losses"][0][0] == plain["losses"][0][0]  # the first step reads the initial weights
        assert skipped["losses"][1][0] != plain["losses"][1][0]


def _waits_of_one_forward(rank, world):
    """The counts a GPT's forward waits for, with every gather of a 2-rank buffer pending."""
    from megalite import parallel
    from megalite.models import GPTModel, TransformerConfig
    from megalite.optim.buffers import ParamAndGradBuffer
    from megalite.optim.param_gather import attach_gather_waits

    parallel.initialize_model_parallel(1)
    config = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=100,
                               max_position_embeddings=16)
    chunk = GPTModel(config, seed=0)
    buf = ParamAndGradBuffer(list(chunk.parameters()), param_dtype=torch.float32, grad_dtype=torch.float32,
                             bucket_numel=3000, dp_group=None, dp_size=2, reduce_scatter=True, dp_rank=0)
    waits = []
    attach_gather_waits(chunk, buf)
    buf.wait_param_gather = waits.append
    buf.finish_param_gather = lambda: waits.append("all")
    buf._gathers = [None] * len(buf.buckets)  # every gather pending: the hooks wait
    with torch.no_grad():
        chunk(torch.zeros(2, 16, dtype=torch.long), torch.arange(16).expand(2, 16))
    position = {n: buf.gather_position(buf.bucket_of[id(p)]) for n, p in chunk.named_parameters()}
    parts = [[[position[f"layers.{i}.{name}.{n}"] for n, _ in part.named_parameters()]
              for name, part in layer.named_children()] for i, layer in enumerate(chunk.layers)]
    return waits, position, parts, len(buf.buckets)


def test_gathers_are_posted_in_forward_order_and_each_part_of_a_layer_waits_for_its_own():
    waits, position, layers, buckets = run_ranks(_waits_of_one_forward, 1)[0]
    assert buckets > 3
    assert position["word_embeddings.weight"] == 1  # defined first: posted first
    counts = [w for w in waits if w != "all"]
    # The chunk's pre-hook waits for the embeddings' buckets; each layer's (it has no parameters of
    # its own) for those before; then each of its parts (norm, attention, norm, MLP) for its own.
    count = max(position["word_embeddings.weight"], position["position_embeddings.weight"])
    expected = [count]
    for parts in layers:
        expected.append(count)
        for part in parts:
            count = max(count, *part)
            expected.append(count)
    assert counts == expected
    # the attention of layer 0 runs while the MLP's buckets travel
    assert max(layers[0][1]) < max(layers[0][3]) <= buckets
    assert waits[len(counts):] == ["all", "all"]  # the last layer's post-hook, then the chunk's


@pytest.mark.parametrize("argv, says", [
    (["--overlap-param-gather"], "add --use-distributed-optimizer"),
    (["--overlap-param-gather", "--use-distributed-optimizer", "--torch-compile"], "drop one of them"),
])
def test_the_flag_without_a_distributed_optimizer_or_with_compile_is_refused_in_one_line(argv, says, capsys):
    import pretrain_gpt
    code = pretrain_gpt.main(["--mock-data", "--train-iters", "1", *argv])
    err = capsys.readouterr().err
    assert code != 0 and says in err and len(err.strip().splitlines()) == 1, err


def test_at_stage_3_the_flag_is_a_note_and_the_printed_configuration_says_false(capsys):
    import pretrain_gpt
    assert pretrain_gpt.main(["--mock-data", "--zero-stage", "3", FLAG, "--print-config"]) == 0
    captured = capsys.readouterr()
    assert "overlap_param_gather = false" in captured.out
    assert "--overlap-param-gather (--zero-stage 3 gathers each layer beside the layer before it, always)" in captured.err
    assert pretrain_gpt.main(["--mock-data", "--use-distributed-optimizer", FLAG, "--print-config"]) == 0
    assert "overlap_param_gather = true" in capsys.readouterr().out
