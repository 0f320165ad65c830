"""A run's configuration: typed sections (megalite.config.sections), the command line and config
files generated from them, and the rules that join them. docs/configuration.md lists every field."""
from megalite.config.cli import ConfigParser, build_parser
from megalite.config.expand import expanded
from megalite.config.files import read_config_file, to_toml
from megalite.config.layout import validate
from megalite.config.rules import (lr_schedule_lengths, model_config, model_dtype, resolve, stream_dtype,
                                   weight_decay_steps)
from megalite.config.run import SECTIONS, ConfigError, RunConfig
from megalite.config.model_sections import ModelConfig
from megalite.config.output_sections import CheckpointConfig, LoggingConfig
from megalite.config.optimizer_section import OptimizerConfig
from megalite.config.sections import (DataConfig, DataParallelConfig, LocalSGDConfig, ParallelConfig,
                                      TrainingConfig)
from megalite.config.precision import PrecisionConfig

__all__ = ["SECTIONS", "CheckpointConfig", "ConfigError", "ConfigParser", "DataConfig", "DataParallelConfig",
           "LocalSGDConfig", "LoggingConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig", "PrecisionConfig",
           "RunConfig", "TrainingConfig", "build_parser", "expanded", "lr_schedule_lengths", "model_config", "model_dtype",
           "read_config_file", "resolve", "stream_dtype", "to_toml", "validate", "weight_decay_steps"]
