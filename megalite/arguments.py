"""The entry points' command line, kept under its old import path: everything lives in
megalite.config now (typed sections, the parser generated from them, the rules that join them)."""
from megalite.config import build_parser, model_config, model_dtype, validate

__all__ = ["build_parser", "model_config", "model_dtype", "validate"]
