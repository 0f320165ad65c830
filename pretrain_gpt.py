"""Pretrain a GPT with tensor, pipeline and data parallelism.

    torchrun --standalone --nproc_per_node 4 pretrain_gpt.py --tp 2 --pp 2

With no --data-path it trains on the embedded corpus (the Python standard library's sources,
tokenized once into a cache); --mock-data uses a synthetic token stream.
"""

from megalite import runtime
from megalite.data import build_gpt_datasets
from megalite.data.blends import split_blends, split_flags
from megalite.data.synthetic import SyntheticTokens
from megalite.models import GPTModel
from megalite.models.mtp import WithMTPTargets
from megalite.training import Task, entry, gpt_forward_step, prepare_data, train_valid_datasets
from megalite.training.datasets import document_flags, sft_datasets, test_dataset, with_document_flags
from megalite.training.validation_sets import each_dataset


def prepare(cfg):
    return prepare_data(cfg, kind="gpt")


def build_model(config, cfg, device, pre_process=True, post_process=True, layer_numbers=None):
    return GPTModel(config, pre_process, post_process, layer_numbers, seed=cfg.training.seed, device=device)


def _datasets(config, cfg):
    def datasets(samples, lock_timeout):  # token ids are checked against the model's vocabulary
        whole, per_split = split_blends(cfg.data)
        return build_gpt_datasets(whole, cfg.data.split, cfg.model.seq_length, samples, cfg.training.seed,
                                  vocab_size=config.vocab_size, lock_timeout=lock_timeout, per_split=per_split,
                                  flags=split_flags(cfg.data), valid_epoch=cfg.training.full_validation,
                                  valid_sets=cfg.training.multiple_validation_sets)
    return datasets


def _as_trained(config, flags, data):
    """A split's samples as the model reads them: packed documents (--reset-attention-mask ...: `flags`,
    `document_flags`) before multi-token prediction's targets, which shift the loss mask."""
    data = with_document_flags((data,), flags)[0]
    depth = getattr(config, "mtp_num_layers", 0)  # (a config of another type may not know of it)
    return WithMTPTargets(data, depth) if depth else data  # MTP reads tokens further on, cut before CP splits


def build_data(config, cfg):
    if cfg.data.sft_data_path:  # fine-tuning on conversations, each a document (docs/sft.md)
        train, valid = sft_datasets(cfg)
        depth = getattr(config, "mtp_num_layers", 0)
        if depth:
            train, valid = WithMTPTargets(train, depth), each_dataset(valid, lambda d: WithMTPTargets(d, depth))
        return train, valid
    train, valid = train_valid_datasets(cfg, config.vocab_size, SyntheticTokens, _datasets(config, cfg))
    flags = document_flags(cfg, config.vocab_size)
    return _as_trained(config, flags, train), each_dataset(valid, lambda d: _as_trained(config, flags, d))


def build_test_data(config, cfg):
    test = test_dataset(cfg, config.vocab_size, SyntheticTokens, _datasets(config, cfg))
    return None if test is None else _as_trained(config, document_flags(cfg, config.vocab_size), test)


def task() -> Task:
    return Task(build_model, build_data, gpt_forward_step, prepare, build_test_data=build_test_data)


def main(argv=None) -> int:
    return entry.main(argv, task(), "Pretrain a GPT with megalite.", default_model="gpt-tiny")


if __name__ == "__main__":
    runtime.exit_process(main())
