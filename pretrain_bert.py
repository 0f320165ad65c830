"""Pretrain a BERT (masked language model + sentence order) with tensor, pipeline and data parallelism.

    torchrun --standalone --nproc_per_node 4 pretrain_bert.py --tp 2 --pp 2

With no --data-path it trains on the embedded corpus (standard-library sources, one sentence per
line); --mock-data uses a synthetic stream.
"""

import functools

import torch

from megalite import runtime
from megalite.data import data_tokenizer
from megalite.data.bert_dataset import build_bert_datasets
from megalite.data.blends import split_blends
from megalite.data.synthetic import SyntheticBERT
from megalite.models import BERTModel
from megalite.errors import UsageError
from megalite.training import Task, entry, prepare_data, train_valid_datasets
from megalite.training.datasets import test_dataset


def prepare(cfg):
    cfg = prepare_data(cfg, kind="bert")
    for flag, words in (("--data-path", cfg.data.data_path), ("--train-data-path", cfg.data.train_data_path),
                        ("--valid-data-path", cfg.data.valid_data_path), ("--test-data-path", cfg.data.test_data_path)):
        if words and len(words) != 1:
            raise UsageError(f"pretrain_bert.py takes one {flag} prefix (blending is for GPT)")
    if cfg.parallel.cp > 1:
        raise UsageError("--cp splits causal (GPT) attention; BERT's bidirectional attention with padding masks is "
                         "not context-parallel: drop --cp")
    return cfg


def build_model(config, cfg, device, pre_process=True, post_process=True, layer_numbers=None):
    return BERTModel(config, pre_process, post_process, layer_numbers, seed=cfg.training.seed, device=device)


def _bert_data(config, cfg):
    """(the synthetic stream with this masking, the datasets builder)"""
    d = cfg.data
    masking = dict(mask_prob=d.mask_prob, binary_head=config.add_binary_head)

    def datasets(samples, lock_timeout):  # token ids are checked against the model's vocabulary
        whole, per_split = split_blends(d)
        for words in (whole, *(per_split or ())):
            if words is not None and len(words) != 1:  # (read from a file: checked here)
                raise ValueError(f"pretrain_bert.py reads one prefix a split, not {' '.join(words)} (blending is "
                                 f"for GPT)")
        return build_bert_datasets(whole[0] if whole else None, d.split, cfg.model.seq_length, samples,
                                   cfg.training.seed, data_tokenizer(d), vocab_size=config.vocab_size,
                                   lock_timeout=lock_timeout, short_seq_prob=d.short_seq_prob,
                                   per_split=per_split and tuple(w and w[0] for w in per_split), **masking)

    return functools.partial(SyntheticBERT, **masking), datasets


def build_data(config, cfg):
    return train_valid_datasets(cfg, config.vocab_size, *_bert_data(config, cfg))


def build_test_data(config, cfg):
    return test_dataset(cfg, config.vocab_size, *_bert_data(config, cfg))


def bert_forward_step(model, batch):
    """Summed MLM loss over masked tokens plus the sentence-order loss weighted so that, divided by
    the global masked-token count, the objective is mean MLM + mean SOP over the global batch. The
    loop scales the loss masks first unless --calculate-per-token-loss, so the MLM part is Megatron-LM's
    mean of micro-batch means (`Task.loss_counts_vary`)."""
    # Without the binary head (--bert-no-binary-head) the model has no token types and no SOP loss.
    out = model(batch["tokens"], token_type_ids=batch["token_types"] if model.num_tokentypes else None,
                padding_mask=batch["padding_mask"], lm_labels=batch["labels"],
                sop_labels=batch["sop_labels"] if model.add_binary_head else None)
    if not model.post_process:
        return out
    mlm, sop = out
    mlm_sum = (mlm * batch["loss_mask"]).sum()
    if sop is None:
        batch["loss_terms"] = {"mlm_loss": mlm_sum.detach(), "sop_loss": torch.zeros_like(mlm_sum)}
        return mlm_sum
    sop_sum = sop.sum() * batch["num_tokens"] / batch["global_batch_size"]
    # The two parts, normalized like the loss, for the log: the loop divides them by the token count.
    batch["loss_terms"] = {"mlm_loss": mlm_sum.detach(), "sop_loss": sop_sum.detach()}
    return mlm_sum + sop_sum


def task() -> Task:
    return Task(build_model, build_data, bert_forward_step, prepare, model_kind="bert",
                loss_terms=("mlm_loss", "sop_loss"), perplexity_of="mlm_loss", loss_counts_vary=True,
                build_test_data=build_test_data)


def main(argv=None) -> int:
    return entry.main(argv, task(), "Pretrain a BERT with megalite.", default_model="bert-tiny")


if __name__ == "__main__":
    runtime.exit_process(main())
