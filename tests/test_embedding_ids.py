"""VocabParallelEmbedding's id check (MEGALITE_DEBUG_IDS=1 or check_ids=True): an id outside the
vocabulary is named, at tp=1 (where the lookup would crash or read a padding row) and at tp=2
(where it would silently look up zeros); off by default."""
import os

import pytest
import torch

from megalite import parallel
from megalite.testing import run_ranks

TABLE, REAL_VOCAB, DIM = 256, 200, 8  # rows 200..255 are padding


def _lookup(check_ids, ids, env_value=None):
    """The lookup's outcome: 'ok' and the output, or the error's type and message."""
    if env_value is not None:
        os.environ["MEGALITE_DEBUG_IDS"] = env_value
    torch.manual_seed(0)
    emb = parallel.VocabParallelEmbedding(TABLE, DIM, num_real_embeddings=REAL_VOCAB, check_ids=check_ids)
    try:
        return "ok", emb(torch.tensor(ids))
    except Exception as e:  # noqa: BLE001 - the outcome is what we compare
        return f"{type(e).__name__}: {e}", None


def _cases(rank, world):
    parallel.initialize_model_parallel(world)
    return {
        "padding row": _lookup(True, [[5, 230, 7]])[0],
        "beyond the table": _lookup(True, [[300, 1]])[0],
        "negative": _lookup(True, [[3, -1]])[0],
        "env on": _lookup(None, [[5, 230]], env_value="1")[0],
        "env off": _lookup(None, [[5, 230]], env_value="0")[0],
        "in range, checked": _lookup(True, [[0, 199, 42]]),
        "in range, unchecked": _lookup(False, [[0, 199, 42]]),
    }


@pytest.mark.parametrize("tp", [1, 2])
def test_debug_mode_names_the_out_of_range_id_and_the_vocabulary_size(tp):
    for got in run_ranks(_cases, tp):
        assert got["padding row"] == ("TokenIdError: token id 230 is outside the vocabulary of 200 ids (0..199): "
                                      "the data was made with another tokenizer; give the right --tokenizer or "
                                      "--vocab-size")
        assert got["beyond the table"].startswith("TokenIdError: token id 300 is outside the vocabulary of 200 ids")
        assert got["negative"].startswith("TokenIdError: token id -1 is outside")
        assert got["env on"].startswith("TokenIdError: token id 230")
        assert got["env off"] == "ok", "off by default: tp>1 looks the id up as zeros, as before"
        (ok, checked), (_, unchecked) = got["in range, checked"], got["in range, unchecked"]
        assert ok == "ok" and torch.equal(checked, unchecked)


def test_token_id_error_is_a_usage_error_reported_in_one_line():
    from megalite.parallel.layers import TokenIdError
    from megalite.runtime import UsageError

    assert issubclass(TokenIdError, UsageError)
