"""A non-editable install works outside the source tree (``make test-install``).

The wheel is built from a copy of the package sources (``pip wheel --no-deps --no-build-isolation``)
and installed with ``--no-deps --target`` (the dependencies are the running venv's); every command
then runs from an empty directory outside the checkout with that target on ``PYTHONPATH``.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("moe_lit", "configs", "eval/templates", "pyproject.toml", "README.md")
CHECKS = """
import json, sys
from pathlib import Path
import moe_lit
from moe_lit.cli import main
from moe_lit.commands import demo
from moe_lit.data.layout import default_data_dir
from moe_lit.evaluation.tasks import TEMPLATES_DIR
from moe_lit.resources import CONFIGS_DIR

try:
    main(["demo", "--help"])
except SystemExit as exc:
    demo_help = exc.code
codes = {
    "demo --help": demo_help,
    "accounting": main(["accounting", "--config", "configs/model/tiny-moe.yaml"]),
    "study": main(["study", "list", "configs/studies/upcycling.yaml", "--out", "study"]),
    "fit": main(["fit", "--config", "configs/experiments/tiny-moe.yaml", "--print_config"]),
}
Path(sys.argv[1]).write_text(json.dumps({
    "package": moe_lit.__file__,
    "configs_symlink": CONFIGS_DIR.is_symlink(),
    "demo_models": [str(path) for path in demo.MODELS.values() if path.is_file()],
    "templates": sorted(path.name for path in TEMPLATES_DIR.iterdir()),
    "data_dir": str(default_data_dir()),
    "codes": codes,
}))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The install target holding the built wheel's files."""
    src, dist, site = (tmp_path_factory.mktemp(name) for name in ("src", "dist", "site"))
    for name in SOURCES:
        source, target = REPO / name, src / name
        if source.is_dir():
            shutil.copytree(source, target, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", dist, src], check=True, capture_output=True
    )
    (wheel,) = dist.glob("moe_lit-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", site, wheel], check=True, capture_output=True)
    return site


def _run(cmd, site: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MOE_LIT_DATA"}
    env["PYTHONPATH"] = str(site)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def test_console_script_runs_outside_the_checkout(site, tmp_path):
    proc = _run([site / "bin" / "moe-lit", "--help"], site, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "demo" in proc.stdout and "study" in proc.stdout


def test_commands_find_the_packaged_configs(site, tmp_path):
    proc = _run([sys.executable, "-c", CHECKS, "checks.json"], site, tmp_path)
    assert proc.returncode == 0, proc.stderr
    info = json.loads((tmp_path / "checks.json").read_text())
    assert Path(info["package"]).is_relative_to(site)
    assert info["codes"] == {"demo --help": 0, "accounting": 0, "study": 0, "fit": 0}, proc.stderr
    assert "--tokens" in proc.stdout  # demo's help
    assert not info["configs_symlink"]  # the wheel holds copies, not the checkout's links
    assert len(info["demo_models"]) == 2 and all(Path(p).is_relative_to(site) for p in info["demo_models"])
    assert info["templates"] == sorted(p.name for p in (REPO / "eval" / "templates").iterdir())
    assert Path(info["data_dir"]) == tmp_path / "data_cache" / "default"  # not inside the install
    assert "| tiny-moe | 256 | 8 | 2 |" in proc.stdout  # accounting's table (seq_len, experts, top_k)
    assert "up_utility_copy/s0" in proc.stdout  # the study's points
    assert "seed_everything: 0" in proc.stdout  # the experiment's config, composed from ../model, ../trainer
