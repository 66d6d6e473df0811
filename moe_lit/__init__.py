"""moe_lit: Lightning-based training, conversion and evaluation of dense and Mixture-of-Experts LMs."""

from moe_lit.config import ConfigError, ModelConfig, MoEConfig

__version__ = "0.1.0"
__all__ = ["ConfigError", "ModelConfig", "MoEConfig", "__version__"]
