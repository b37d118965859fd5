"""Algorithms: one file each, registered here by the name used in `+algo=NAME`.

A test checks this registry matches configs/algo/*.yaml.
"""
from algorithms.attuner import Attuner, AttunerConfig
from algorithms.clm import CLM, CLMConfig
from algorithms.distill import Distill, DistillConfig
from algorithms.grpo import GRPO, GRPOConfig
from algorithms.mass import MASS, MASSConfig
from algorithms.opsd import OPSD, OPSDConfig
from algorithms.qad import QAD, QADConfig
from algorithms.seed import SEED, SEEDConfig
from algorithms.sft import SFT, SFTConfig
from algorithms.skipper import Skipper, SkipperConfig
from algorithms.tesd import TESD, TESDConfig

# name -> (config dataclass, algorithm class)
REGISTRY: dict[str, tuple[type, type]] = {
    "sft": (SFTConfig, SFT),
    "opsd": (OPSDConfig, OPSD),
    "mass": (MASSConfig, MASS),
    "tesd": (TESDConfig, TESD),
    "distill": (DistillConfig, Distill),
    "grpo": (GRPOConfig, GRPO),
    "seed": (SEEDConfig, SEED),
    "qad": (QADConfig, QAD),
    "skipper": (SkipperConfig, Skipper),
    "attuner": (AttunerConfig, Attuner),
    "clm": (CLMConfig, CLM),
}


def config_schemas() -> dict[str, type]:
    return {name: cfg for name, (cfg, _) in REGISTRY.items()}


def build_algorithm(cfg):
    return REGISTRY[cfg.name][1](cfg)
