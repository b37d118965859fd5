"""Algorithms: one file each, registered here by the name used in `+algo=NAME`.

A test checks this registry matches configs/algo/*.yaml.
"""
from algorithms.sft import SFT, SFTConfig

# name -> (config dataclass, algorithm class)
REGISTRY: dict[str, tuple[type, type]] = {
    "sft": (SFTConfig, SFT),
}


def config_schemas() -> dict[str, type]:
    return {name: cfg for name, (cfg, _) in REGISTRY.items()}


def build_algorithm(cfg):
    return REGISTRY[cfg.name][1](cfg)
