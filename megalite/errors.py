"""The two errors a run ends with in one line (no traceback). A module of its own that imports
nothing, so every layer can raise them without importing the runtime."""


class UsageError(ValueError):
    """A problem with the user's arguments, data or files: reported as one line, no traceback."""


class TrainingStopped(RuntimeError):
    """Training cannot go on (e.g. gradients inf/NaN too many times): one line, non-zero exit."""
