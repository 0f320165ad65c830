"""Megatron-LM's own example scripts, as their flags reach the entry point (read in the public
repository: examples/gpt3/train_gpt3_175b_distributed.sh, examples/bert/train_bert_340m_distributed.sh,
examples/llama/train_llama3_8b_h100_fp8.sh, examples/mixtral/train_mixtral_8x7b_distributed.sh; paths replaced), checked with --print-config at their
layouts' world sizes. What megalite does not do is listed per script (FP8, which needs FP8 tensor
cores and Transformer Engine), and each such flag must be refused in one line saying why; everything
else must pass."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _words(text: str) -> list[str]:
    return text.split()


GPT3_175B = _words("""
--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048
--attention-backend auto --micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375
--train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0
--fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --data-path DATA/prefix_text_document
--vocab-file DATA/gpt2-vocab.json --merge-file DATA/gpt2-merges.txt --split 949,50,1 --log-interval 100
--save-interval 10000 --eval-interval 1000 --save CKPT --load CKPT --eval-iters 10 --tensorboard-dir TB""")

BERT_340M = _words("""
--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512 --max-position-embeddings 512
--attention-backend auto --micro-batch-size 4 --global-batch-size 32 --train-iters 1000000 --weight-decay 1e-2
--clip-grad 1.0 --fp16 --lr 0.0001 --lr-decay-iters 990000 --lr-decay-style linear --min-lr 1.0e-5
--weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 --tensor-model-parallel-size 8
--pipeline-model-parallel-size 16 --data-path DATA/bert_text_sentence --vocab-file DATA/bert-vocab.txt
--split 949,50,1 --log-interval 100 --save-interval 10000 --eval-interval 1000 --save CKPT --load CKPT
--eval-iters 10 --tensorboard-dir TB""")

LLAMA3_8B_FP8 = _words("""
--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192
--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
--hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
--untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1 --global-batch-size 128
--train-samples 1953125000 --lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001
--decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1
--adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion
--calculate-per-token-loss --manual-gc --empty-unused-memory-level 1 --exit-duration-in-mins 235
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --fp8-format hybrid
--fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather --tensor-model-parallel-size 1
--context-parallel-size 1 --sequence-parallel --mock-data --tokenizer-type NullTokenizer --vocab-size 128256
--data-cache-path CACHE --tiktoken-pattern v2 --split '99,1,0' --no-create-attention-mask-in-dataloader
--no-mmap-bin-files --num-workers 1 --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000
--log-throughput --profile --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist
--distributed-timeout-minutes 60 --save CKPT --load CKPT --tensorboard-dir TB""")

# examples/mixtral/train_mixtral_8x7b_distributed.sh (PP 4, EP 8 on 4 nodes of 8)
MIXTRAL_8X7B = _words("""
--use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768 --num-layers 32
--hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --init-method-std 0.01 --attention-dropout 0.0
--hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8 --no-masked-softmax-fusion
--no-position-embedding --rotary-base 1000000 --num-experts 8 --moe-router-topk 2
--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm
--moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce --tokenizer-type Llama2Tokenizer
--tokenizer-model DATA/tokenizer.model --data-path DATA/prefix_text_document --split 99990,8,2 --micro-batch-size 1
--global-batch-size 256 --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine
--min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16 --tensor-model-parallel-size 1
--pipeline-model-parallel-size 4 --expert-model-parallel-size 8 --use-distributed-optimizer --sequence-parallel
--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --save CKPT --load CKPT
--tensorboard-dir TB --no-load-optim --no-load-rng""")



def _stored(name: str) -> list[str]:
    """An argument list kept in tests/data/megatron_examples/ (its header says where it was read)."""
    text = (ROOT / "tests" / "data" / "megatron_examples" / f"{name}.args").read_text()
    return _words(" ".join(line for line in text.splitlines() if not line.startswith("#")))


QWEN3_30B_A3B = _stored("qwen3_30b_a3b")
DEEPSEEK_V3 = _stored("deepseek_v3")

# script -> (entry point, world size of its layout, what megalite refuses today: flag -> values it takes)
SCRIPTS = {
    "gpt3_175b": ("pretrain_gpt.py", 8 * 16, GPT3_175B, {}),
    "bert_340m": ("pretrain_bert.py", 8 * 16, BERT_340M, {}),
    "llama3_8b_fp8": ("pretrain_gpt.py", 8, LLAMA3_8B_FP8, {}),
    "mixtral_8x7b": ("pretrain_gpt.py", 8 * 4, MIXTRAL_8X7B, {}),
    "qwen3_30b_a3b": ("pretrain_gpt.py", 1, QWEN3_30B_A3B, {}),  # model arguments only: one rank's layout
    "deepseek_v3": ("pretrain_gpt.py", 1, DEEPSEEK_V3, {}),
}


def _without(argv: list[str], refused: dict) -> list[str]:
    out, skip = [], 0
    for word in argv:
        if skip:
            skip -= 1
        elif word in refused:
            skip = refused[word]
        else:
            out.append(word)
    return out


def _print_config(entry, world, argv, tmp_path, here=None):
    """`WORLD_SIZE=world python entry argv --print-config`, launched; or, given `here` (pytest's
    monkeypatch and capsys), the entry point's main(argv) in this process with that environment (no
    rank variables): the same parse, checks and printing, without a Python start-up each."""
    argv = [str(tmp_path / w) if w in ("CKPT", "TB", "CACHE", "TOKENIZER") or w.startswith("DATA/") else w
            for w in argv]
    if here is None:
        return subprocess.run([sys.executable, str(ROOT / entry), *argv, "--print-config"], capture_output=True,
                              text=True, timeout=120, cwd=ROOT,
                              env={"WORLD_SIZE": str(world), "PATH": "/usr/bin:/bin"})
    import importlib

    monkeypatch, capsys = here
    monkeypatch.setenv("WORLD_SIZE", str(world))
    for name in ("RANK", "LOCAL_RANK", "MEGALITE_QUIET", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    capsys.readouterr()
    code = importlib.import_module(Path(entry).stem).main([*argv, "--print-config"])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([entry, *argv, "--print-config"], code, out, err)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_megatron_example_is_refused_only_for_what_megalite_cannot_do(name, tmp_path, monkeypatch, capsys):
    """One example (gpt3_175b) is launched as a process; the others run the entry point's main in this one."""
    entry, world, argv, refused = SCRIPTS[name]
    here = None if name == "gpt3_175b" else (monkeypatch, capsys)
    if refused:
        run = _print_config(entry, world, argv, tmp_path, here)
        assert run.returncode == 2 and run.stdout == ""
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and next(iter(refused)) in lines[0], run.stderr
    run = _print_config(entry, world, _without(argv, refused), tmp_path, here)
    if name == "bert_340m":  # 24 layers on 16 stages: Megatron-LM refuses this layout too; the line names the fix
        assert run.returncode == 2
        # named as the script spells it (megalite's own flag is --pp)
        assert "the number of layers (24) is not divisible by --pipeline-model-parallel-size (16)" in run.stderr
        assert "--pipeline-layers" in run.stderr
        run = _print_config(entry, world, argv + ["--pipeline-layers", ",".join(["2"] * 8 + ["1"] * 8)], tmp_path,
                            here)
    assert run.returncode == 0, run.stderr
    assert "[parallel]" in run.stdout


def test_the_llama_example_resolves_to_megatrons_numbers(tmp_path):
    from megalite.config import build_parser, lr_schedule_lengths, model_config
    from megalite.precision.recipes import Recipe

    _, _, argv, refused = SCRIPTS["llama3_8b_fp8"]
    cfg = build_parser("x", "gpt-tiny").parse_args(_without(argv, refused))
    model = model_config(cfg)
    assert cfg.training.train_iters == 1953125000 // 128
    assert lr_schedule_lengths(cfg)[:2] == (3906252 / 128, 1949218748 / 128)
    assert (model.head_dim, model.ffn_hidden_size, model.num_query_groups, model.rotary_base) == (128, 14336, 8, 1e6)
    assert cfg.data_parallel.grad_reduce_dtype == "bf16" and cfg.data_parallel.zero_stage == 1
    assert (cfg.optimizer.decoupled_lr, cfg.optimizer.decoupled_min_lr) == (5.0e-4, 4.5e-5)
    assert model.layernorm_zero_centered_gamma and model.normalization == "layernorm"
    assert not cfg.parallel.sequence_parallel and "--sequence-parallel (with --tp 1)" in cfg.ignored_flags
    assert {"--use-mcore-models", "--manual-gc", "--profile", "--ckpt-format"} <= set(cfg.ignored_flags)
    # FP8 as the script asks: hybrid formats, delayed scaling (Megatron-LM's default recipe) over 1024 steps' max
    assert cfg.precision.fp8() == Recipe("delayed", "hybrid", 1024, "max", 0, True)
    # ZeRO-1 gathers in the model dtype (the same numbers): the FP8 gather is ZeRO-3's, said in a note
    assert not cfg.precision.fp8_param_gather and any("--fp8-param-gather" in f for f in cfg.ignored_flags)


def test_the_mixtral_example_resolves_to_its_experts_and_layout():
    from megalite.config import build_parser, model_config

    cfg = build_parser("x", "gpt-tiny").parse_args(SCRIPTS["mixtral_8x7b"][2])
    model = model_config(cfg)
    assert (model.num_moe_experts, model.moe_router_topk, model.moe_aux_loss_coeff) == (8, 2, 1e-2)
    assert model.position_embedding_type == "rope" and model.gated_linear_unit and model.moe_ffn_hidden_size == 14336
    assert (cfg.parallel.pp, cfg.parallel.expert_model_parallel_size) == (4, 8)
    assert "--moe-grouped-gemm" in cfg.ignored_flags


def _byte_level_chars() -> list[str]:
    """GPT-2's byte-to-character table: printable bytes stand for themselves, the rest for 256 + n."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _tokenizer_files_and_data(root: Path, name: str) -> dict:
    """A tiny GPT-2 BPE (vocab.json, merges.txt) and BERT WordPiece vocabulary, and a corpus preprocessed
    with Megatron-LM's tokenizer flags: with the BPE for gpt3_175b, with the WordPiece for bert_340m."""
    import json
    import random

    from megalite.data.preprocess import main as preprocess

    vocab = {c: i for i, c in enumerate(_byte_level_chars())}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (root / "gpt2-vocab.json").write_text(json.dumps(vocab))
    (root / "gpt2-merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    words = "the quick brown fox jumps over the lazy dog in winter there".split()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = [*"abcdefghijklmnopqrstuvwxyz", *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz")]
    (root / "bert-vocab.txt").write_text("\n".join(dict.fromkeys(specials + pieces + words)) + "\n")
    rng = random.Random(0)

    def sentence():
        return " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))

    with open(root / "docs.jsonl", "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": "\n".join(sentence() for _ in range(rng.randint(3, 6)))}) + "\n")
    if name == "gpt3_175b":
        preprocess(["--input", str(root / "docs.jsonl"), "--output-prefix", str(root / "prefix_text_document"),
                    "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(root / "gpt2-vocab.json"),
                    "--merge-file", str(root / "gpt2-merges.txt"), "--append-eod"])
    else:
        preprocess(["--input", str(root / "docs.jsonl"), "--output-prefix", str(root / "bert_text_sentence"),
                    "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(root / "bert-vocab.txt"),
                    "--split-sentences"])
    return {f"DATA/{p.name}": str(p) for p in root.iterdir()} | {
        "DATA/prefix_text_document": str(root / "prefix_text_document"),
        "DATA/bert_text_sentence": str(root / "bert_text_sentence")}


TINY = {"--rampup-batch-size": "2", "--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "64",
        "--max-position-embeddings": "64", "--micro-batch-size": "2", "--global-batch-size": "8", "--train-iters": "3",
        "--lr-decay-iters": "3", "--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2",
        "--log-interval": "1", "--eval-iters": "1"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt3_175b", "bert_340m"])
def test_the_examples_scaled_down_train_on_data_their_tokenizer_flags_made(name, tmp_path):
    """gpt3_175b runs under torchrun; bert_340m runs its entry point's main on ranks of one spawn."""
    from cli import records, torchrun
    from training_ranks import entry_main

    from megalite.testing import run_ranks

    entry, _, argv, refused = SCRIPTS[name]
    paths = _tokenizer_files_and_data(tmp_path, name)
    paths.update({"CKPT": str(tmp_path / "ckpt"), "TB": str(tmp_path / "tb")})
    argv = _without(argv, refused)
    argv = [TINY[argv[i - 1]] if i and argv[i - 1] in TINY else paths.get(w, w) for i, w in enumerate(argv)]
    if "--rampup-batch-size" in argv:  # 2 -> 8 samples a step by 2 over the first 16 samples
        at = argv.index("--rampup-batch-size")
        argv[at + 1:at + 4] = ["2", "2", "16"]
    metrics = tmp_path / "m.jsonl"
    if name == "gpt3_175b":
        run = torchrun(entry, 4, *argv, "--metrics-file", str(metrics), timeout=400)
        assert run.returncode == 0, run.stderr[-3000:]
        stdout = run.stdout
    else:
        ranks = run_ranks(entry_main, 4, args=([*argv, "--metrics-file", str(metrics)], Path(entry).stem), timeout=400,
                          env={"MEGALITE_QUIET": ""})
        assert [code for code, *_ in ranks] == [0] * 4
        stdout = ranks[0][1]
    recs = records(metrics)
    assert [r["iteration"] for r in recs] == [1, 2, 3] and all(r["skipped"] == 0 for r in recs)
    if name == "gpt3_175b":  # the ramp: 2 samples a step, then 4 after int(6 / (16 / 3)) = 1 increment
        assert [r["consumed_samples"] for r in recs] == [2, 4, 6]
    assert "saved checkpoint iteration 3" in stdout


def test_the_qwen3_and_deepseek_examples_resolve_to_their_models():
    from megalite.config import build_parser, model_config

    qwen = build_parser("x", "gpt-tiny").parse_args(QWEN3_30B_A3B)
    model = model_config(qwen)
    assert (model.num_moe_experts, model.moe_router_topk, model.moe_ffn_hidden_size, model.kv_channels) == (128, 8, 768,
                                                                                                           128)
    assert model.qk_layernorm and model.gated_linear_unit and model.num_query_groups == 4
    assert qwen.model.openai_gelu is False  # Megatron-LM's flags give the model: its exact GeLU (unused by SwiGLU)
    deepseek = build_parser("x", "gpt-tiny").parse_args(DEEPSEEK_V3)
    model = model_config(deepseek)
    assert model.multi_latent_attention and (model.q_lora_rank, model.kv_lora_rank) == (1536, 512)
    assert (model.num_moe_experts, model.moe_router_topk, model.moe_router_score_function) == (256, 8, "sigmoid")
    assert list(model.moe_layer_freq) == [0] * 3 + [1] * 58
    assert "--moe-shared-expert-overlap" in deepseek.ignored_flags


# Tiny sizes for the MoE examples (the rest of each argument list as Megatron-LM gives it): one rank, two steps.
TINY_MOE = {"--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "4",
            "--num-query-groups": "2", "--kv-channels": "16", "--num-experts": "4", "--moe-ffn-hidden-size": "32",
            "--moe-router-topk": "2", "--seq-length": "32", "--max-position-embeddings": "64",
            "--make-vocab-size-divisible-by": "128", "--kv-lora-rank": "16", "--q-lora-rank": "24",
            "--qk-head-dim": "16", "--qk-pos-emb-head-dim": "8", "--v-head-dim": "16", "--moe-layer-freq": "[0]*1+[1]*1",
            "--moe-router-num-groups": "2", "--moe-router-group-topk": "1", "--moe-shared-expert-intermediate-size": "32",
            "--rotary-scaling-factor": "4"}


def _tiny_moe_losses(rank, world, argv):
    from training_ranks import gpt_run

    return [(r["loss"], r["skipped"]) for r in gpt_run(argv).records]


@pytest.mark.parametrize("name", ["qwen3_30b_a3b", "deepseek_v3"])
def test_the_moe_examples_scaled_down_train(name):
    from megalite.testing import run_ranks

    argv = SCRIPTS[name][2]
    argv = [TINY_MOE[argv[i - 1]] if i and argv[i - 1] in TINY_MOE else w for i, w in enumerate(argv)]
    at = argv.index("--tokenizer-type")  # no tokenizer files here: synthetic tokens of a small vocabulary
    argv[at:at + 2] = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "255"]
    at = argv.index("--tokenizer-model")
    del argv[at:at + 2]
    argv += ["--mock-data", "--train-iters", "2", "--global-batch-size", "2", "--log-interval", "1",
             "--eval-interval", "0", "--lr", "1e-3", "--min-lr", "1e-4"]
    argv = [w for w in argv if w != "--bf16"]  # fp32 on CPU
    records = run_ranks(_tiny_moe_losses, 1, args=(argv,))[0]
    assert len(records) == 2 and all(skipped == 0 for _, skipped in records)
    assert all(loss == loss and 0 < loss < 20 for loss, _ in records)

