"""Hydra configuration: typed schemas and composition."""

from ftrain.config.compose import (
    ConfigError,
    config_hash,
    flat_config,
    load_config,
    recorded_config,
    to_plain,
)
from ftrain.config.schema import Config, register_configs

__all__ = [
    "Config",
    "ConfigError",
    "config_hash",
    "flat_config",
    "load_config",
    "recorded_config",
    "register_configs",
    "to_plain",
]
