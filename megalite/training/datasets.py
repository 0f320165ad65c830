"""A run's data: the data section resolved against the model (tokenizer, vocabulary size), and
the train and validation datasets for the run's length."""
from __future__ import annotations

import dataclasses

from megalite.config import RunConfig
from megalite.data import data_tokenizer, named_data, resolve_data
from megalite.data.documents import DocumentFlags, WithDocuments, flags_given
from megalite.data.sft import build_sft_datasets
from megalite.config.batch_schedule import batch_schedule
from megalite.errors import UsageError
from megalite.runtime import say
from megalite.training import upcycling


def prepare_data(cfg: RunConfig, kind: str) -> RunConfig:
    """`cfg` with --data-path and --tokenizer filled in (the embedded corpus when none is given) and
    the vocabulary size the tokenizer needs."""
    data, vocab_size, _ = resolve_data(cfg.data, cfg.model.vocab_size, kind)
    return dataclasses.replace(cfg, data=data, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))


def train_valid_datasets(cfg, vocab_size: int, synthetic, build) -> tuple:
    """(train, valid or None) for a run: with --mock-data two `synthetic(vocab_size, seq_length,
    seed)` streams, else `build(samples, lock_timeout)`'s datasets for (train, valid, test) sample
    counts, waiting on another rank's cache no longer than on a collective. Bad data becomes one
    usage error."""
    if cfg.data.mock_data:
        return (synthetic(vocab_size, cfg.model.seq_length, seed=cfg.training.seed),
                synthetic(vocab_size, cfg.model.seq_length, seed=cfg.training.seed + 1))
    t = cfg.training  # --full-validation: any count asks for the validation data, read whole
    valid_samples = (1 if t.full_validation else t.eval_iters) * t.global_batch_size if t.eval_interval else 0
    try:
        # the samples the run reads: a ramp-up or step schedule's batches, not train_iters full ones
        train_samples = batch_schedule(t, cfg.model.seq_length).samples_for_steps(t.train_iters)
        train_samples = upcycling.train_samples(cfg, train_samples)  # from the dense run's position on
        train, valid, _ = build((train_samples, valid_samples, 0), cfg.parallel.distributed_timeout_minutes * 60)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if train is None:
        d = cfg.data
        raise UsageError(f"--split {d.split} leaves no training documents" if d.data_path or d.data_args_path else
                         f"the training split's data ({named_data(d)}) holds no documents")
    return train, valid




def test_dataset(cfg, vocab_size: int, synthetic, build):
    """Megatron-LM's test split, evaluated on --eval-iters global batches once training ends: a
    `synthetic(vocab_size, seq_length, seed)` stream with --mock-data, else `build`'s third dataset (None
    where the data has no test split, e.g. --split 90,10,0, and when the run never evaluates)."""
    t = cfg.training
    if not (t.eval_iters and t.eval_interval) or cfg.data.sft_data_path:
        return None
    if cfg.data.mock_data:
        return synthetic(vocab_size, cfg.model.seq_length, seed=t.seed + 2)
    try:
        return build((0, 0, t.eval_iters * t.global_batch_size), cfg.parallel.distributed_timeout_minutes * 60)[2]
    except ValueError as e:
        if cfg.data.test_data_path or cfg.data.per_split_data_args_path:  # named for its own sake: it must be right
            raise UsageError(str(e)) from None
        # --split's test part of data chosen for training (the default 969,30,1 leaves a sliver): training
        # goes on without the test evaluation, said once
        say(f"megalite: note: no test evaluation: {e} (the test split is --split's third part; --split X,Y,0 "
            f"gives none)")
        return None


def sft_datasets(cfg: RunConfig) -> tuple:
    """(train, valid or None) of --sft-data-path: conversations packed into sequences whose documents
    attend to themselves with positions from 0 (megalite.data.sft, megalite.data.documents)."""
    from megalite.config.sections import split_weights
    from megalite.runtime import say

    d = cfg.data
    tokenizer = data_tokenizer(d)
    try:
        train, valid = build_sft_datasets(d.sft_data_path, tokenizer, cfg.model.seq_length, split_weights(d.split),
                                          cfg.training.seed, pack=not d.sft_no_packing)
    except ValueError as e:  # DatasetError, and a tokenizer without an EOD
        raise UsageError(str(e)) from None
    cut = train.cut + (valid.cut if valid is not None else 0)
    if cut:
        say(f"note: {cut} conversation(s) of {d.sft_data_path} are longer than --seq-length {cfg.model.seq_length} "
            f"+ 1 tokens and were cut to it")
    flags = DocumentFlags(tokenizer.eod, reset_attention_mask=True, reset_position_ids=True)
    return with_document_flags((train, valid), flags)


def micro_batch_means_apply(cfg: RunConfig, loss_counts_vary: bool = False) -> bool:
    """Whether the loss is Megatron-LM's mean of micro-batch means and that differs from the per-token
    mean: micro-batches may count different numbers of loss tokens (--eod-mask-loss, SFT, or the task's
    own masking: `Task.loss_counts_vary`), and no --calculate-per-token-loss."""
    varies = loss_counts_vary or cfg.data.eod_mask_loss or cfg.data.sft_data_path
    return bool(varies) and not cfg.training.calculate_per_token_loss


def loss_form(cfg: RunConfig, loss_counts_vary: bool = False) -> str:
    """What a checkpoint records of the run's loss (metadata "loss"): "micro_batch_means" or "per_token"."""
    return "micro_batch_means" if micro_batch_means_apply(cfg, loss_counts_vary) else "per_token"


def document_flags(cfg: RunConfig, vocab_size: int) -> DocumentFlags | None:
    """Megatron-LM's --reset-attention-mask / --reset-position-ids / --eod-mask-loss with the token
    that ends a document: the tokenizer's EOD, or with --mock-data the last id of the vocabulary
    (where Megatron-LM's NullTokenizer puts it). None when none is given."""
    d = cfg.data
    given = flags_given(d)
    if not given:
        return None
    eod = vocab_size - 1 if d.mock_data else data_tokenizer(d).eod
    if eod is None:
        raise UsageError(f"{' '.join(given)} find documents by the end-of-document token, and the tokenizer "
                         f"has none: use a tokenizer with an EOS/EOD token (and data preprocessed with --append-eod)")
    return DocumentFlags(eod, d.reset_attention_mask, d.reset_position_ids, d.eod_mask_loss)


def with_document_flags(datasets: tuple, flags: DocumentFlags | None) -> tuple:
    """(train, valid) whose batches carry the document flags' effects (megalite.data.documents)."""
    if flags is None:
        return datasets
    return tuple(None if d is None else WithDocuments(d, flags) for d in datasets)
