"""Text generation from megalite models at any layout: a key/value cache kept out of the modules
(`cache`), greedy and seeded sampling (`sampling`), one step through the pipeline (`stages`), the
loop (`generate`), continuations scored (`scoring`, lm-eval's forward: `lm_eval_adapter`), and samples for the training log (`samples`). The command line is
`python -m megalite.tools.generate`; docs/generate.md."""
from megalite.generation.cache import KVCache
from megalite.generation.generate import Completions, generate, prompt_ids
from megalite.generation.samples import log_samples, read_prompts
from megalite.generation.sampling import Sampling, filtered, next_tokens
from megalite.generation.scoring import score

__all__ = ["Completions", "KVCache", "Sampling", "filtered", "generate", "log_samples", "next_tokens", "prompt_ids",
           "read_prompts", "score"]
