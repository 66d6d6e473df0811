"""Fail the install when any runtime dependency does not import (e.g. a torchvision/torch mismatch)."""

import importlib
import sys

MODULES = [
    "torch",
    "lightning",
    "lightning.pytorch",
    "jsonargparse",
    "docstring_parser",
    "torchmetrics",
    "litdata",
    "tokenizers",
    "lxml.etree",
    "yaml",
    "safetensors.torch",
    "matplotlib",
    "rich",
    "tqdm",
    "tensorboard",
    "lm_eval",
    "scipy",
    "statsmodels.stats.weightstats",
    "transformers",
    "gguf",
    "accelerate",
    "moe_lit",
]

failed = []
for name in MODULES:
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - report every broken import, then fail once
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
if failed:
    sys.exit("dependencies that do not import:\n  " + "\n  ".join(failed))
import torch  # noqa: E402

print(f"all {len(MODULES)} dependencies import (torch {torch.__version__})")
