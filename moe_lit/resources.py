"""Files shipped inside the package: the YAML configs and the local-suite templates.

In a source checkout ``moe_lit/configs`` and ``moe_lit/evaluation/templates`` are symlinks to the
repository's ``configs/`` and ``eval/templates/`` (the one copy that is edited); a wheel
(``pip install .``) holds them as package data, so the same paths resolve after an install.

A command-line argument that names a file under ``configs/`` (``moe-lit fit --config
configs/experiments/tiny-moe.yaml``, ``moe-lit study run configs/studies/upcycling-e8-e32.yaml``) and does
not exist under the working directory names the packaged file: the documented commands run from
any directory. A ``configs/`` tree in the working directory always wins.
"""

from __future__ import annotations

from pathlib import Path

CONFIGS_DIR = Path(__file__).parent / "configs"
"""The packaged ``configs/`` (model, trainer, data, experiment and study YAML files)."""
CONFIGS_PREFIX = "configs/"


def packaged_config(arg: str) -> str:
    """``arg``, or the packaged file it names when it is ``configs/...`` and absent under the cwd.

    ``--option=configs/...`` is resolved the same way; every other argument is returned unchanged.
    """
    option, sep, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    if not value.startswith(CONFIGS_PREFIX) or Path(value).exists():
        return arg
    packaged = CONFIGS_DIR / value.removeprefix(CONFIGS_PREFIX)
    return f"{option}{sep}{packaged}" if packaged.exists() else arg
