"""Samples during training: greedy completions of a file of prompts, written to the log and to
TensorBoard as text, from the model chunks the training loop holds (every rank calls it)."""
from __future__ import annotations

from pathlib import Path

from megalite.generation.generate import generate


def read_prompts(path) -> list[str]:
    """The prompts of a file, one a line (empty lines skipped)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"the prompts file {path} does not exist")
    prompts = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"the prompts file {path} holds no prompts (one a line)")
    return prompts


def log_samples(model_chunks, prompts, tokenizer, iteration: int, say=print, tensorboard=None,
                max_new_tokens: int = 32, v_shape: bool = False) -> list[str]:
    """Complete `prompts` (texts, or a file of them) greedily, say one line per prompt
    (`say`: the logging rank's printer) and add them to `tensorboard` (a SummaryWriter, where this
    rank has one) as the text "samples" at step `iteration`. Returns the completions."""
    if not isinstance(prompts, (list, tuple)):
        prompts = read_prompts(prompts)
    out = generate(model_chunks, prompts, tokenizer=tokenizer, max_new_tokens=max_new_tokens, v_shape=v_shape)
    for prompt, text in zip(prompts, out.texts):
        say(f"megalite: sample at iteration {iteration}: {prompt!r} -> {text!r}")
    if tensorboard is not None:
        rows = "\n".join(f"| {_cell(p)} | {_cell(t)} |" for p, t in zip(prompts, out.texts))
        tensorboard.add_text("samples", f"| prompt | completion |\n| --- | --- |\n{rows}", iteration)
    return out.texts


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")
