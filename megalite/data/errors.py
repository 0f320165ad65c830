"""DatasetError, the data package's error (bad dataset files, caches, locks, tokenizers): a module of its own
below the others, so that any of them raises it without importing another."""


class DatasetError(ValueError):
    """A dataset file is missing, truncated or corrupt."""
