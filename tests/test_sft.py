"""Supervised fine-tuning (--sft-data-path): the loss on the replies only, conversations packed and
each attending to itself, equal to the conversations run one by one; a tiny model fine-tuned on the
shipped conversation file answers in its format."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers import assert_rel_close, full_tensors
from megalite import parallel
from megalite.data import build_tokenizer
from megalite.data.documents import DocumentFlags, with_documents
from megalite.data.sft import SFTDataset, conversation, read_records
from megalite.models import GPTModel
from megalite.models.presets import preset
from megalite.testing import run_ranks
from training_ranks import entry_main
from megalite.training.batches import context_parallel_share
from megalite.training.task import gpt_forward_step

CONVERSATIONS = Path(__file__).parent / "data" / "sft_conversations.jsonl"
WORDS = ["<pad>", "<eos>", "<", ">", "user", "assistant", "end", ".", "?", "i", "like", "and", "you", "red", "green",
         "blue", "yellow", "black", "white", "orange", "purple", "cars", "hats", "shoes", "boats", "cups", "kites"]
# <role> content <end>, turn after turn; the generation prompt opens the assistant's turn.
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <end> {% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")


def make_tokenizer(directory: Path) -> Path:
    """A word-level Hugging Face tokenizer with a chat template, saved in `directory`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("sft-tokenizer"))


def ids(tok, text):
    return tok.tokenize(text)


def test_replies_alone_are_trained_in_both_record_forms(tokenizer_dir):
    tok = build_tokenizer(str(tokenizer_dir))
    plain = conversation({"prompt": "i like red cars .", "response": "you like red ."}, tok)
    assert plain.tokens == ids(tok, "i like red cars .") + ids(tok, "you like red .") + [tok.eod]
    assert plain.trained == [False] * 5 + [True] * 5  # the reply and the EOD that ends it
    chat = conversation({"messages": [{"role": "user", "content": "i like red cars ."},
                                      {"role": "assistant", "content": "you like red ."},
                                      {"role": "user", "content": "and blue cars ?"},
                                      {"role": "assistant", "content": "you like blue ."}]}, tok)
    rendered = ids(tok, "< user > i like red cars . < end > < assistant > you like red . < end > "
                        "< user > and blue cars ? < end > < assistant > you like blue . < end >")
    assert chat.tokens == rendered + [tok.eod]
    trained = [tok.detokenize([t]) for t, on in zip(chat.tokens, chat.trained) if on]
    assert trained == "you like red . < end > you like blue . < end > <eos>".split()


def test_bad_records_and_tokenizers_are_one_line(tmp_path, tokenizer_dir):
    from megalite.data.indexed import DatasetError

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"text": "no"}\n')
    with pytest.raises(DatasetError, match="line 2 has neither"):
        read_records(bad)
    bad.write_text('{"prompt": "a"\n')
    with pytest.raises(DatasetError, match="line 1 is not JSON"):
        read_records(bad)
    tok = build_tokenizer(str(tokenizer_dir))
    tok.tok.chat_template = None
    with pytest.raises(DatasetError, match="tokenizer has none"):
        conversation({"messages": [{"role": "user", "content": "i"}]}, tok)


def test_packing_fills_rows_and_the_loss_mask_points_at_reply_tokens(tokenizer_dir):
    tok = build_tokenizer(str(tokenizer_dir))
    convs = [conversation(r, tok) for r in read_records(CONVERSATIONS)]
    packed, alone = SFTDataset(convs, 63, tok.eod, seed=1), SFTDataset(convs, 63, tok.eod, seed=1, pack=False)
    assert len(alone) == len(convs) and len(packed) < 0.75 * len(convs)
    # Rows hold the conversations in file order, each whole, then EOD padding with no loss.
    tokens = [t for row, trained in packed.rows for t in row[:_content(row, trained, tok.eod)]]
    assert tokens == [t for c in convs for t in c.tokens]
    batch = packed.batch(range(len(packed)))
    # Each counted position's label is a reply token: never a user word like "i" or "and".
    labels = batch["labels"][batch["loss_mask"] > 0]
    assert not set(labels.tolist()) & {WORDS.index("i"), WORDS.index("and"), WORDS.index("user")}
    assert int(batch["loss_mask"].sum()) == sum(sum(c.trained) for c in convs)


def _content(row, trained, eod) -> int:
    """Length of a packed row's conversations: up to the last trained token (each ends with its EOD)."""
    return int(max(i for i, on in enumerate(trained) if on)) + 1


def _sums(model, rows) -> torch.Tensor:
    """The masked loss summed over rows (a batch each), gradients accumulated in the model."""
    total = 0.0
    for batch in rows:
        loss = gpt_forward_step(model, batch)
        loss.backward()
        total += loss.detach()
    return total


def packed_and_alone(rank, world, tokenizer_dir, layouts):
    """At each (tp, cp, sp): the summed reply loss and full gradients over the conversation file,
    packed into 63-token rows, and one conversation a row."""
    tok = build_tokenizer(str(tokenizer_dir))
    convs = [conversation(r, tok) for r in read_records(CONVERSATIONS)][:8]
    flags = DocumentFlags(tok.eod, reset_attention_mask=True, reset_position_ids=True)
    out = []
    for tp, cp, sp in layouts:
        parallel.initialize_model_parallel(tp, 1, context_parallel_size=cp)
        model = GPTModel(preset("llama-tiny", vocab_size=len(WORDS), sequence_parallel=sp), seed=3).eval()
        params = dict(model.named_parameters())
        results = []
        for pack in (True, False):
            data = SFTDataset(convs, 64, tok.eod, seed=1, pack=pack)
            rows = [with_documents(data.batch(range(k, k + 1)), flags) for k in range(len(data))]  # every row once
            if cp > 1:
                rows = [context_parallel_share(b, 64, parallel.get_context_parallel_rank(), cp) for b in rows]
            model.zero_grad()
            total = _sums(model, rows)
            for p in params.values():
                if cp > 1:
                    dist.all_reduce(p.grad, group=parallel.get_context_parallel_group())
                if tp > 1 and getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=parallel.get_tensor_model_parallel_group())
            if cp > 1:
                dist.all_reduce(total, group=parallel.get_context_parallel_group())
            results.append((total, full_tensors({n: p.grad for n, p in params.items()}, params, len(WORDS))))
        out.append(results)
        parallel.destroy_model_parallel()
    return out


def test_packed_conversations_equal_unpacked_at_tp2_sp_and_cp2(tokenizer_dir):
    layouts = [(2, 1, True), (1, 2, False)]
    for layout, ((packed, g_packed), (alone, g_alone)) in zip(layouts, run_ranks(
            packed_and_alone, 2, args=(str(tokenizer_dir), layouts))[0]):
        assert_rel_close(packed, alone, what=f"summed reply loss at {layout}")
        for name, g in g_alone.items():
            assert_rel_close(g_packed[name], g, what=f"grad of {name} at {layout}")


def test_the_packed_loss_is_the_masked_loss_written_by_hand(tokenizer_dir):
    run_ranks(_hand_loss, 1, args=(str(tokenizer_dir),))


def _hand_loss(rank, world, tokenizer_dir):
    tok = build_tokenizer(str(tokenizer_dir))
    convs = [conversation(r, tok) for r in read_records(CONVERSATIONS)][:6]
    parallel.initialize_model_parallel(1, 1)
    model = GPTModel(preset("llama-tiny", vocab_size=len(WORDS)), seed=3).eval()
    data = SFTDataset(convs, 80, tok.eod, seed=1)
    batch = with_documents(data.batch(range(len(data))), DocumentFlags(tok.eod, True, True))
    with torch.no_grad():
        ours = gpt_forward_step(model, batch)
        by_hand = 0.0
        for c in convs:  # each conversation alone: cross-entropy where the next token is a reply's
            logits = model(torch.tensor([c.tokens[:-1]]))[0, :, :len(WORDS)]
            targets = torch.tensor(c.tokens[1:])
            trained = torch.tensor(c.trained[1:])
            by_hand += torch.nn.functional.cross_entropy(logits[trained], targets[trained], reduction="sum")
    assert_rel_close(ours, by_hand, what="summed reply loss")


def hf_greedy(model, tok, n: int = 6) -> str:
    """transformers' greedy answer to a question the conversation file does not hold."""
    question = tok.apply_chat_template([{"role": "user", "content": "i like green kites and red kites ."}],
                                       tokenize=True, add_generation_prompt=True, return_tensors="pt")
    question = question["input_ids"] if hasattr(question, "keys") else question
    with torch.no_grad():
        out = model.generate(question, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, question.shape[1]:])


def fine_tune(rank, world, argv):
    import pretrain_gpt
    from megalite.training import pretrain
    from training_ranks import parse

    return [r["loss"] for r in pretrain(parse(argv), pretrain_gpt.task()).records]


@pytest.mark.slow
def test_an_imported_model_fine_tuned_100_steps_exports_and_answers_in_the_trained_format(tmp_path):
    """The whole path: a Hugging Face Llama (with its tokenizer and chat template) imported, fine-tuned
    on the shipped conversations from `--load` of the import, exported, and asked by transformers."""
    import transformers as tf

    from megalite.tools import convert_hf

    hf_dir, imported, tuned, exported = (tmp_path / d for d in ("hf", "imported", "tuned", "exported"))
    torch.manual_seed(0)
    config = tf.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, vocab_size=len(WORDS), max_position_embeddings=128,
                            bos_token_id=None, eos_token_id=WORDS.index("<eos>"), pad_token_id=WORDS.index("<pad>"),
                            tie_word_embeddings=False)
    tf.LlamaForCausalLM(config).save_pretrained(hf_dir)
    make_tokenizer(hf_dir)
    tok = tf.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    before = hf_greedy(tf.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval(), tok)
    assert convert_hf.main(["import", "--hf-dir", str(hf_dir), "--out", str(imported)]) == 0
    argv = ["--load", str(imported), "--save", str(tuned), "--sft-data-path", str(CONVERSATIONS), "--tokenizer",
            str(hf_dir), "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "3e-3",
            "--lr-warmup-iters", "5", "--train-iters", "100", "--log-interval", "10", "--eval-interval", "0",
            "--save-interval", "100"]
    [losses] = run_ranks(fine_tune, 1, args=(argv,), timeout=300)
    assert losses[-1] < 0.3 * losses[0], losses
    assert convert_hf.main(["export", "--load", str(tuned), "--out", str(exported)]) == 0
    after = hf_greedy(tf.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval(), tok)
    (tmp_path / "answers.json").write_text(json.dumps({"before": before, "after": after}))
    words = after.split()  # the reply's form: "you like <the first colour> . <end>"
    assert not before.startswith("you like")
    assert words[:5] == ["you", "like", "green", ".", "<"], after


def test_eval_prompts_print_greedy_samples_at_each_validation(tokenizer_dir, tmp_path):
    # The entry point's main on a rank of run_ranks (forked from its warm fork server) rather than a
    # `python pretrain_gpt.py` each: the same parse, run and one-line error, without two start-ups.
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("i like red cars and blue cars .\n\nyou like\n")
    argv = ["--model", "llama-tiny", "--sft-data-path", str(CONVERSATIONS),
            "--tokenizer", str(tokenizer_dir), "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size",
            "4", "--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "2",
            "--eval-prompts", str(prompts)]
    [(code, stdout, stderr)] = run_ranks(entry_main, 1, args=(argv,), timeout=300, env={"MEGALITE_QUIET": ""})
    assert code == 0, stderr[-2000:]
    lines = [line for line in stdout.splitlines() if "sample at iteration" in line]
    assert [line.split(":")[1].strip() for line in lines] == ["sample at iteration 2"] * 2 + ["sample at iteration 4"] * 2
    assert "'i like red cars and blue cars .' ->" in lines[0] and "'you like' ->" in lines[1]
    [(code, _, stderr)] = run_ranks(entry_main, 1, args=(argv[:-1] + [str(tmp_path / "missing.txt")],),
                                    timeout=300, env={"MEGALITE_QUIET": ""})
    assert code != 0 and "--eval-prompts: the prompts file" in stderr and "Traceback" not in stderr
