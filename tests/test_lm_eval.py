"""lm-evaluation-harness on megalite checkpoints (megalite.generation.lm_eval_adapter,
python -m megalite.tools.lm_eval): a tiny Llama imported from Hugging Face scores on three tasks built
from local files (multiple choice, generation until a stop string, rolling perplexity over windows)
exactly as lm-eval's own Hugging Face model scores megalite's export of it, at one device, tp 2 x pp 2
and two data-parallel replicas; `--eval-tasks` scores them during training."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
tf = pytest.importorskip("transformers")

from megalite.testing import run_ranks  # noqa: E402
from test_sft import WORDS, make_tokenizer  # noqa: E402

QUESTIONS = [("i like red cars and blue cars .", ["you like red .", "you like blue .", "you like green ."], 1),
             ("i like green hats .", ["you like green .", "you like black .", "i like hats ."], 0),
             ("i like white boats and black boats .", ["you like white .", "you like black .", "you like red ."], 2),
             ("you like orange kites ?", ["i like orange .", "i like kites .", "you like purple ."], 0),
             ("i like yellow cups and red cups .", ["you like yellow .", "you like cups .", "you like red ."], 1)]
TEXTS = ["i like red cars and blue cars . you like red . " * 6, "you like white boats ? i like white . " * 3,
         "green hats and black shoes ."]
TASKS = ["colours_choice", "colours_answer", "colours_text"]
MAX_POSITIONS = 32  # the rolling texts need several windows


def _metric(name: str, aggregation: str, higher_is_better: bool) -> str:
    return f"  - metric: {name}\n    aggregation: {aggregation}\n    higher_is_better: {str(higher_is_better).lower()}\n"


def _task_files(directory: Path) -> Path:
    """Three lm-eval tasks over local JSON lines files (no hub access)."""
    directory.mkdir(parents=True, exist_ok=True)
    chat = [{"question": f"< user > {q} < end > < assistant >", "choices": c, "answer": a} for q, c, a in QUESTIONS]
    (directory / "questions.jsonl").write_text("".join(json.dumps(d) + "\n" for d in chat))
    (directory / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    common = (f"dataset_path: json\ndataset_kwargs:\n  cache_dir: {directory / 'cache'}\n  data_files:\n"
              f"    test: {directory / '{}'}\ntest_split: test\n")
    (directory / "choice.yaml").write_text(
        "task: colours_choice\n" + common.format("questions.jsonl") + "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n" + _metric("acc", "mean", True) + _metric("acc_norm", "mean", True))
    (directory / "answer.yaml").write_text(
        "task: colours_answer\n" + common.format("questions.jsonl") + "output_type: generate_until\n"
        "doc_to_text: '{{question}}'\ndoc_to_target: '{{choices[answer]}}'\n"
        "generation_kwargs:\n  until: ['< end', '?']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n" + _metric("exact_match", "mean", True))
    (directory / "text.yaml").write_text(
        "task: colours_text\n" + common.format("texts.jsonl") + "output_type: loglikelihood_rolling\n"
        "doc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n" + _metric("word_perplexity", "weighted_perplexity", False)
        + _metric("byte_perplexity", "weighted_perplexity", False) + _metric("bits_per_byte", "bits_per_byte", False))
    return directory


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """(Hugging Face directory with its tokenizer, megalite import, megalite's export, task directory)."""
    from megalite.tools import convert_hf

    root = tmp_path_factory.mktemp("lm-eval")
    hf_dir, imported, exported = root / "hf", root / "imported", root / "exported"
    torch.manual_seed(0)
    # Large initial weights: confident next-token choices, so greedy answers and accuracies are not ties.
    config = tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=64, vocab_size=len(WORDS), max_position_embeddings=MAX_POSITIONS,
                            bos_token_id=None, eos_token_id=WORDS.index("<eos>"), pad_token_id=WORDS.index("<pad>"),
                            tie_word_embeddings=False, initializer_range=0.3)
    tf.LlamaForCausalLM(config).save_pretrained(hf_dir)
    make_tokenizer(hf_dir)
    assert convert_hf.main(["import", "--hf-dir", str(hf_dir), "--out", str(imported)]) == 0
    assert convert_hf.main(["export", "--load", str(imported), "--out", str(exported)]) == 0
    return hf_dir, imported, exported, _task_files(root / "tasks")


def _scores(results) -> tuple[dict[str, float], dict]:
    """(the metrics, each task's answers per document: log-likelihoods, texts generated)."""
    from megalite.generation.lm_eval_adapter import scores

    answers = {task: {s["doc_id"]: s["resps"] for s in samples} for task, samples in results["samples"].items()}
    return scores(results), answers


@pytest.fixture(scope="module")
def task_index(model_dirs):
    """lm-eval's task manager for the task directory (its built-in tasks and ours), built once: indexing
    lm-eval's thousands of task files takes ~13 s of CPU in each process that does it. The pytest
    process's adapter finds it in its per-directory cache; ranks and subprocesses load the pickle
    returned (`_with_task_index`), so each indexes nothing. Every check of the names still runs."""
    import pickle

    from lm_eval.tasks import TaskManager

    from megalite.generation import lm_eval_adapter

    tasks = str(model_dirs[3])
    manager = TaskManager(include_path=tasks)
    path = model_dirs[3].parent / "task_manager.pickle"
    path.write_bytes(pickle.dumps(manager))
    lm_eval_adapter._MANAGERS[tasks] = manager
    yield manager, str(path)
    lm_eval_adapter._MANAGERS.pop(tasks, None)


def _with_task_index(pickled: str, include_path: str) -> None:
    """In a rank: the adapter's cached task manager for `include_path` is the pickled one (task_index)."""
    import pickle
    from pathlib import Path

    from megalite.generation import lm_eval_adapter

    lm_eval_adapter._MANAGERS[include_path] = pickle.loads(Path(pickled).read_bytes())


@pytest.fixture(scope="module")
def hf_scores(model_dirs, task_index):
    """lm-eval's own Hugging Face model on the export."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    hf_dir, _, exported, tasks = model_dirs
    lm = HFLM(pretrained=str(exported), tokenizer=str(hf_dir), batch_size=1, device="cpu", dtype="float32")
    results = lm_eval.simple_evaluate(model=lm, tasks=TASKS, task_manager=task_index[0],
                                      log_samples=True, bootstrap_iters=0, verbosity="ERROR")
    return _scores(results)


def _megalite_scores(rank, world, load, tokenizer, tasks, layouts, index):
    """lm-eval through MegaliteLM at each (tp, pp) of `layouts` (the rest of the ranks data-parallel)."""
    from megalite import parallel
    from megalite.data import build_tokenizer
    from megalite.generation.lm_eval_adapter import MegaliteLM, evaluate_tasks
    from megalite.tools.generate import build_stage

    _with_task_index(index, tasks)
    out = {}
    for tp, pp in layouts:
        parallel.initialize_model_parallel(tp, pp)
        model, _ = build_stage(load, tp, pp, "cpu")
        lm = MegaliteLM([model], build_tokenizer(tokenizer), batch_size=3, shard_over_data_parallel=True)
        results = evaluate_tasks(lm, TASKS, tasks, log_samples=True)
        out[(tp, pp)] = _scores(results) if parallel.get_data_parallel_rank() == 0 else None
        parallel.destroy_model_parallel()
    return out


def _flat(answers):
    """Every number and text of the answers, in order."""
    if isinstance(answers, (list, tuple)):
        return [x for a in answers for x in _flat(a)]
    return [answers]


def _assert_same(ours: tuple, theirs: tuple, what: str):
    (ours, our_answers), (theirs, their_answers) = ours, theirs
    assert set(ours) == set(theirs) and len(ours) == 6, (what, sorted(ours), sorted(theirs))
    for key, value in theirs.items():
        if key.split("/")[1] in ("acc", "acc_norm", "exact_match"):
            assert ours[key] == value, (what, key, ours[key], value)
        else:  # perplexities: the same sums, added in another order
            assert math.isclose(ours[key], value, rel_tol=1e-5), (what, key, ours[key], value)
    # Request by request: each continuation's log-likelihood and greedy flag, each rolling sum, each text.
    assert set(our_answers) == set(TASKS) and our_answers.keys() == their_answers.keys()
    for task in TASKS:
        assert our_answers[task].keys() == their_answers[task].keys(), (what, task)
        for doc, answer in their_answers[task].items():
            mine, hers = _flat(our_answers[task][doc]), _flat(answer)
            if "dp" in what:  # lm-eval evens the replicas' shares by running a replica's last request twice
                mine = mine[:len(hers)]
            assert len(mine) == len(hers) > 0, (what, task, doc)
            for a, b in zip(mine, hers):
                if isinstance(b, float):
                    assert math.isclose(a, b, rel_tol=1e-5), (what, task, doc, mine, hers)
                else:
                    assert a == b, (what, task, doc, mine, hers)


def test_scores_equal_lm_evals_hugging_face_model_on_the_export(model_dirs, task_index, hf_scores):
    hf_dir, imported, _, tasks = model_dirs
    # Not all answers right nor all wrong: the comparison can tell models apart.
    metrics, answers = hf_scores
    assert 0 < metrics["colours_choice/acc"] < 1 and metrics["colours_text/word_perplexity"] > 1
    texts = [t for a in answers["colours_answer"].values() for t in _flat(a)]
    assert all(isinstance(t, str) for t in texts) and len(set(texts)) > 1, texts  # greedy texts, not all alike
    [ours] = run_ranks(_megalite_scores, 1, args=(str(imported), str(hf_dir), str(tasks), [(1, 1)], task_index[1]),
                       timeout=300)
    _assert_same(ours[(1, 1)], hf_scores, "one device")


@pytest.mark.slow
def test_scores_are_the_same_at_tp2_pp2_and_over_data_parallel_replicas(model_dirs, task_index, hf_scores):
    hf_dir, imported, _, tasks = model_dirs
    results = run_ranks(_megalite_scores, 4, args=(str(imported), str(hf_dir), str(tasks), [(2, 2), (2, 1)],
                                                   task_index[1]), timeout=420)
    _assert_same(results[0][(2, 2)], hf_scores, "tp 2 x pp 2")
    _assert_same(results[0][(2, 1)], hf_scores, "tp 2 x dp 2")  # requests dealt over the two replicas
    assert results[1][(2, 2)] == results[0][(2, 2)]  # every rank of the first replica has the numbers


def test_cli_prints_the_table_writes_json_and_refuses_in_one_line(model_dirs, task_index, hf_scores, tmp_path,
                                                                  capsys):
    from megalite.tools.lm_eval import main

    hf_dir, imported, _, tasks = model_dirs
    out = tmp_path / "scores.json"
    capsys.readouterr()
    assert main(["--load", str(imported), "--tokenizer", str(hf_dir), "--tasks", "colours_choice,colours_text",
                 "--include-path", str(tasks), "--output-path", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "colours_choice" in printed and "acc" in printed
    saved = json.loads(out.read_text())["results"]
    assert saved["colours_choice"]["acc,none"] == hf_scores[0]["colours_choice/acc"]
    assert main(["--load", str(imported), "--tokenizer", str(hf_dir), "--tasks", "no_such_task",
                 "--include-path", str(tasks)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "knows no task no_such_task" in err[0], err


# --- during training ------------------------------------------------------------------------------

def _train_and_score(rank, world, runs, tokenizer, tasks, index):
    """Each argv of `runs` trained (its losses and --metrics-file records); then the last run's saved
    checkpoint scored again from the file."""
    import pretrain_gpt
    from megalite import parallel
    from megalite.data import build_tokenizer
    from megalite.generation.lm_eval_adapter import MegaliteLM, evaluate_tasks, scores
    from megalite.tools.generate import build_stage
    from megalite.training import pretrain
    from training_ranks import parse

    _with_task_index(index, tasks)
    losses = [[r["loss"] for r in pretrain(parse(argv), pretrain_gpt.task()).records] for argv in runs]
    save = runs[-1][runs[-1].index("--save") + 1]
    if not parallel.model_parallel_is_initialized():
        parallel.initialize_model_parallel(1, 1)
    model, _ = build_stage(save, 1, 1, "cpu")
    reloaded = scores(evaluate_tasks(MegaliteLM([model], build_tokenizer(tokenizer)), ["colours_choice", "colours_text"],
                                     tasks))
    return losses, reloaded


@pytest.mark.slow
def test_eval_tasks_score_the_model_being_trained_and_change_no_training_number(model_dirs, task_index, tmp_path):
    from test_sft import CONVERSATIONS

    hf_dir, _, _, tasks = model_dirs
    metrics = tmp_path / "metrics.jsonl"
    base = ["--model", "llama-tiny", "--num-layers", "2", "--sft-data-path", str(CONVERSATIONS), "--tokenizer",
            str(hf_dir), "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters",
            "4", "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1", "--hidden-dropout", "0.1"]
    scored = base + ["--eval-tasks", "colours_choice,colours_text", "--eval-tasks-path", str(tasks), "--metrics-file",
                     str(metrics), "--save", str(tmp_path / "ckpt"), "--save-interval", "4"]
    [(losses, reloaded)] = run_ranks(_train_and_score, 1, timeout=400,
                                     args=([base, scored], str(hf_dir), str(tasks), task_index[1]))
    assert losses[0] == losses[1]  # lm-eval's seeding does not reach training's generators (dropout here)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    logged = {r["iteration"]: r for r in records if r.get("split") == "lm_eval"}
    assert sorted(logged) == [2, 4]
    keys = {"colours_choice/acc", "colours_choice/acc_norm", "colours_text/word_perplexity",
            "colours_text/byte_perplexity", "colours_text/bits_per_byte"}
    assert keys <= set(logged[4]) and logged[2]["colours_text/word_perplexity"] != logged[4]["colours_text/word_perplexity"]
    for key in keys:  # the last scores are the saved model's
        assert math.isclose(logged[4][key], reloaded[key], rel_tol=1e-6), (key, logged[4][key], reloaded[key])


# `python pretrain_gpt.py ARGS...` run as a script, its lm-eval adapter's cached task manager loaded first
# (task_index): argv is [pickle, task directory, pretrain_gpt.py, ARGS...].
_SCRIPT_WITH_TASK_INDEX = """import os, pickle, runpy, sys
pickled, tasks, sys.argv = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
from megalite.generation import lm_eval_adapter
with open(pickled, "rb") as f:
    lm_eval_adapter._MANAGERS[tasks] = pickle.load(f)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_eval_tasks_refuse_unknown_tasks_before_training_in_one_line(model_dirs, task_index, tmp_path):
    import subprocess
    import sys

    from test_sft import CONVERSATIONS

    hf_dir, _, _, tasks = model_dirs
    root = Path(__file__).parent.parent
    argv = [sys.executable, "-c", _SCRIPT_WITH_TASK_INDEX, task_index[1], str(tasks), str(root / "pretrain_gpt.py"),
            "--model", "llama-tiny", "--sft-data-path",
            str(CONVERSATIONS), "--tokenizer", str(hf_dir), "--seq-length", "32", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "2", "--eval-tasks", "colours_choice,colours_nope",
            "--eval-tasks-path", str(tasks)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    err = [line for line in out.stderr.splitlines() if line.startswith("megalite: error")]
    assert len(err) == 1 and "--eval-tasks: lm-eval knows no task colours_nope" in err[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "iteration" not in out.stdout
