"""Zero-bubble schedules train exactly like 1F1B: `--pipeline-schedule zb-h1` (and zb-v, dualpipev:
the V placement, at the end of this file) against `1f1b` on the
same layout gives the same losses and parameters bit for bit (W runs in micro-batch order, so every
gradient is summed in 1F1B's order), with every parameter's gradient deferred to W in every model
family, at pp 2 and 4, with TP 2 + SP, DP 2, ZeRO-1/2/3, recompute, tied and untied embeddings,
BERT, SwiGLU/RMSNorm/rope, KV groups gathered over TP with a full-width qk norm, experts (EP 2)
and DeepSeek-V3's MLA and MTP."""
import pytest
import torch

from megalite.testing import run_ranks
from training_ranks import parse, placed_params, whole_params

# Two steps: the second runs on weights the first's W passes updated, which is what the schedules must
# get right (a third adds time, not coverage).
BASE = ["--train-iters", "2", "--global-batch-size", "8", "--micro-batch-size", "1", "--log-interval", "1",
        "--seq-length", "32", "--lr-warmup-iters", "0"]
# Every pipeline below runs 2p micro-batches a step (the least dualpipev takes; 1F1B's warm-up, steady
# state and cool-down all run): BASE's 8 at pp 4 and at pp 2 with DP 2, a global batch of 4 (HALF) at
# pp 2 without DP; without a pipeline, 2 (B and W of each, and a gradient accumulated over both).
HALF = ["--global-batch-size", "4"]
# BERT on the synthetic stream with a vocabulary of 1000 instead of WordPiece's 30522 (padded like it, to
# a multiple of 128 x TP): the same MLM head, tied embedding and padding, with 30 times smaller
# embedding GEMMs and Adam steps.
BERT_VOCAB = ["--vocab-size", "1000"]


def train_recording_split(rank, world, case, placed=False):
    """Train `case` = (entry, argv); return losses, parameters, how many weight-gradient thunks W ran,
    and the parameters whose gradient hook saw a gradient during a B (none may)."""
    import pretrain_bert
    import pretrain_gpt
    from megalite import metrics
    from megalite.optim import buffers, zero2
    from megalite.parallel import weight_grad
    from megalite.training import pretrain

    entry, argv = case
    in_b, w_items, evals = set(), [0], []
    # patched for this run only (restored below): one spawn runs many, and wrappers must not nest
    originals = [(cls, "_grad_ready", cls.__dict__["_grad_ready"]) for cls in (buffers.ParamAndGradBuffer,
                                                                               zero2.ShardedGradBuffer)]
    originals += [(metrics.TrainingLogger, "evaluation", metrics.TrainingLogger.evaluation),
                  (weight_grad.WeightGrads, "run", weight_grad.WeightGrads.run)]
    for cls, _, grad_ready in originals[:2]:
        def patched(self, p, original=grad_ready):
            if weight_grad.deferring() and not weight_grad.is_deferred(p):
                in_b.add(id(p))
            return original(self, p)
        cls._grad_ready = patched
    evaluation, run_original = originals[2][2], originals[3][2]

    def recording_evaluation(self, iteration, values, *rest, **named):
        evals.append(values["loss"])
        return evaluation(self, iteration, values, *rest, **named)
    metrics.TrainingLogger.evaluation = recording_evaluation

    def counting_run(self):
        w_items[0] += len(self.items)
        return run_original(self)
    weight_grad.WeightGrads.run = counting_run
    try:
        if entry == "bert":
            run = pretrain(parse(BASE + argv + ["--model", "bert-tiny"] + BERT_VOCAB), pretrain_bert.task())
        else:
            run = pretrain(parse(BASE + argv), pretrain_gpt.task())
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)
    names = {id(p): n for c in run.model_chunks for n, p in c.named_parameters()}
    params = placed_params(run) if placed else whole_params(run)
    return {"losses": [r["loss"] for r in run.records], "params": params, "w_items": w_items[0], "evals": evals,
            "in_b": sorted(names.get(i, "?") for i in in_b)}


def _both(rank, world, cases):
    out = []
    for entry, argv in cases:
        out.append([train_recording_split(rank, world, (entry, argv + ["--pipeline-schedule", kind]))
                    for kind in ("1f1b", "zb-h1")])
    return out


CASES = {  # world size -> (name, entry, argv)
    2: [("gpt pp2", "gpt", ["--pp", "2"] + HALF),
        ("gpt pp2 untied", "gpt", ["--pp", "2", "--untie-embeddings-and-output-weights"] + HALF),
        ("gpt pp1 dp2 zero2 (no pipeline: B and W back to back)", "gpt", ["--zero-stage", "2"] + HALF),
        ("bert pp2", "bert", ["--pp", "2"] + HALF),
        ("llama pp2", "gpt", ["--pp", "2", "--model", "llama-tiny"] + HALF),
        ("deepseek pp2 (MLA, MTP on the last stage)", "gpt", ["--pp", "2", "--model", "deepseek-tiny",
                                                                   "--pipeline-layers", "1,2"] + HALF)],
    4: [("gpt pp4", "gpt", ["--pp", "4"]),
        ("gpt pp2 tp2 sp", "gpt", ["--pp", "2", "--tp", "2", "--sequence-parallel"] + HALF),
        ("gpt pp2 dp2 zero1 recompute", "gpt", ["--pp", "2", "--zero-stage", "1", "--recompute", "full"]),
        ("gpt pp2 dp2 zero3", "gpt", ["--pp", "2", "--zero-stage", "3"]),
        ("bert pp2 tp2", "bert", ["--pp", "2", "--tp", "2"] + HALF),
        ("moe pp2 ep2", "gpt", ["--pp", "2", "--model", "moe-tiny", "--ep", "2"]),
        # (micro-batches of 2: 4 ranks on 2 cores wait on every TP collective of each)
        ("llama tp4: KV groups gathered over TP, full-width qk norm", "gpt",
         ["--tp", "4", "--model", "llama-tiny", "--qk-layernorm", "--qk-layernorm-full-width",
          "--micro-batch-size", "2"] + HALF)],
}


@pytest.fixture(scope="module")
def results():
    return {world: run_ranks(_both, world, args=([(e, a) for _, e, a in cases],), timeout=600)
            for world, cases in CASES.items()}


@pytest.mark.slow
@pytest.mark.parametrize("world,index", [(w, i) for w, cases in CASES.items() for i in range(len(cases))],
                         ids=[name for cases in CASES.values() for name, _, _ in cases])
def test_zb_h1_trains_bitwise_like_1f1b_with_every_weight_gradient_in_w(results, world, index):
    for rank, per_case in enumerate(results[world]):
        one_f_one_b, zb = per_case[index]
        assert zb["losses"] == one_f_one_b["losses"], (rank, zb["losses"], one_f_one_b["losses"])
        assert zb["params"].keys() == one_f_one_b["params"].keys()
        for name, p in one_f_one_b["params"].items():
            assert torch.equal(zb["params"][name], p), (rank, name, (zb["params"][name] - p).abs().max())
        assert zb["in_b"] == [], f"rank {rank}: these parameters got their gradient in B, not W: {zb['in_b']}"
        assert zb["w_items"] > 0 and one_f_one_b["w_items"] == 0


V_KINDS = ("zb-v", "dualpipev")


def _v_against_1f1b(rank, world, cases):
    return [[train_recording_split(rank, world, (entry, argv + ["--pipeline-schedule", kind]), placed=True)
             for kind in ("1f1b", *V_KINDS)] for entry, argv in cases]


NO_CLIP = ["--clip-grad", "0"]  # the global norm would sum the stages' squares in another grouping
V_CASES = {  # world size -> (name, entry, argv, bitwise): zb-v places chunk 1 of rank r at stage 2p-1-r
    2: [("gpt pp2: bitwise", "gpt", ["--pp", "2"] + HALF + NO_CLIP, True),
        ("gpt pp2 clipped (rank 0 holds the first and last stage's squares)", "gpt", ["--pp", "2"] + HALF, False),
        ("gpt pp2 untied, evaluated (forward-only in a V)", "gpt",
         ["--pp", "2", "--untie-embeddings-and-output-weights", "--eval-interval", "2", "--eval-iters", "1"] + HALF
         + NO_CLIP, True),
        ("bert pp2 clipped", "bert", ["--pp", "2", "--num-layers", "4"] + HALF, False),
        ("llama pp2", "gpt", ["--pp", "2", "--model", "llama-tiny"] + HALF + NO_CLIP, True),
        ("deepseek pp2 (MLA, MTP in rank 0's second chunk)", "gpt",
         ["--pp", "2", "--model", "deepseek-tiny", "--num-layers", "4", "--moe-layer-freq", "[0,1,1,1]"] + HALF
         + NO_CLIP, True)],
    4: [("gpt pp4", "gpt", ["--pp", "4", "--num-layers", "8"] + NO_CLIP, True),
        ("gpt pp2 tp2 sp", "gpt", ["--pp", "2", "--tp", "2", "--sequence-parallel"] + HALF + NO_CLIP, True),
        ("gpt pp2 dp2 zero1 recompute", "gpt", ["--pp", "2", "--zero-stage", "1", "--recompute", "full"] + NO_CLIP,
         True),
        ("gpt pp2 dp2 zero3", "gpt", ["--pp", "2", "--zero-stage", "3"] + NO_CLIP, True),
        ("bert pp2 tp2", "bert", ["--pp", "2", "--tp", "2", "--num-layers", "4"] + HALF + NO_CLIP, True),
        ("moe pp2 ep2", "gpt", ["--pp", "2", "--model", "moe-tiny", "--ep", "2"] + NO_CLIP, True)],
}


@pytest.fixture(scope="module")
def v_results():
    return {world: run_ranks(_v_against_1f1b, world, args=([(e, a) for _, e, a, _ in cases],), timeout=900)
            for world, cases in V_CASES.items()}


@pytest.mark.slow
@pytest.mark.parametrize("world,index", [(w, i) for w, cases in V_CASES.items() for i in range(len(cases))],
                         ids=[name for cases in V_CASES.values() for name, _, _, _ in cases])
def test_zb_v_and_dualpipev_train_like_1f1b_with_the_chunks_in_a_v(v_results, world, index):
    """Losses and every parameter (by layout-free name, whichever rank and chunk holds it) as 1F1B's,
    for zb-v and dualpipev: bitwise without gradient clipping; with it the global norm sums the
    stages' squares in another grouping (rank 0 holds the first and the last), so within 1e-5 (Adam
    turns the last bits of a near-zero gradient into a step of up to the learning rate's size)."""
    bitwise = V_CASES[world][index][3]
    merged: list[dict] = [{} for _ in range(1 + len(V_KINDS))]
    for rank, per_case in enumerate(v_results[world]):
        one_f_one_b, *v_runs = per_case[index]
        for kind, zb in zip(V_KINDS, v_runs):
            if bitwise:
                assert zb["losses"] == one_f_one_b["losses"], (kind, rank, zb["losses"], one_f_one_b["losses"])
                assert zb["evals"] == one_f_one_b["evals"], (kind, rank, zb["evals"], one_f_one_b["evals"])
            else:
                assert zb["losses"] == pytest.approx(one_f_one_b["losses"], rel=1e-5, abs=0), kind
            assert zb["in_b"] == [], f"{kind} rank {rank}: these parameters got their gradient in B, not W: {zb['in_b']}"
            assert zb["w_items"] > 0, kind
            assert zb["evals"], f"{kind}: validation (the V's forward-only program) never ran"
        for i, run in enumerate(per_case[index]):
            for key, copies in run["params"].items():
                merged[i].setdefault(key, []).extend(copies)
    for kind, got_run in zip(V_KINDS, merged[1:]):
        assert merged[0].keys() == got_run.keys(), kind
        for key, copies in merged[0].items():
            want = copies[0]
            for got in copies + got_run[key]:  # DP replicas, tied copies, and the V schedule's
                if bitwise:
                    assert torch.equal(got, want), (kind, key, (got - want).abs().max())
                else:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{kind} {key}: {m}")
