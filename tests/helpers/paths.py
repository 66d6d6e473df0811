"""Files of the checkout the tests read."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
STUDIES = CONFIGS / "studies"
EXPERIMENT = str(CONFIGS / "experiments/tiny-moe.yaml")
"""The tiny MoE experiment YAML (``moe-lit fit --config``)."""
