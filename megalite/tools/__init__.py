"""Command-line tools: `python -m megalite.tools.convert_hf` (Hugging Face import / export)."""
