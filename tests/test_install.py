"""A non-editable install works outside the source tree (``make test-install``).

The wheel is built from a copy of the package sources (``pip wheel --no-deps --no-build-isolation``)
and installed with ``--no-deps --target`` (the dependencies are the running venv's); every command
then runs from an empty directory outside the checkout with that target on ``PYTHONPATH``: the
packaged files, and the README's tour at tiny sizes (data prepare, fit, validate, eval, generate,
export, a study dry-run), each step exit 0, its data and outputs in that directory.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli_runs import TINY
from tests.helpers.corpus import write_corpus
from tests.helpers.doc_commands import doc_commands

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("moe_lit", "configs", "eval/templates", "pyproject.toml", "README.md")
CHECKS = """
import json, sys
from pathlib import Path
import moe_lit
from moe_lit.console_script import main
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
    "study": main(["study", "list", "configs/studies/upcycling-e8-e32.yaml", "--out", "study"]),
    "fit": main(["fit", "--config", "configs/experiments/tiny-moe.yaml", "--print_config"]),
}
Path(sys.argv[1]).write_text(json.dumps({
    "package": moe_lit.__file__,
    "configs_symlink": CONFIGS_DIR.is_symlink(),
    "demo_models": [str(path) for path in [*demo.MODELS.values(), demo.RUN] if path.is_file()],
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


def _run(cmd, site: Path, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MOE_LIT_DATA"}
    env.update(PYTHONPATH=str(site), HF_DATASETS_OFFLINE="1")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


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
    assert "--train.max_tokens" in proc.stdout  # demo's help
    assert not info["configs_symlink"]  # the wheel holds copies, not the checkout's links
    assert len(info["demo_models"]) == 3 and all(Path(p).is_relative_to(site) for p in info["demo_models"])
    assert info["templates"] == sorted(p.name for p in (REPO / "eval" / "templates").iterdir())
    assert Path(info["data_dir"]) == tmp_path / "data_cache" / "default"  # not inside the install
    assert "| tiny-moe | 256 | 8 | 2 |" in proc.stdout  # accounting's table (seq_len, experts, top_k)
    assert "up_utility_noise/s0" in proc.stdout  # the study's points
    assert "seed_everything: 0" in proc.stdout  # the experiment's config, composed from ../model, ../trainer


CKPT = "runs/tiny-moe/checkpoints/last.ckpt"
TOUR = [
    # (the words of README.md's tour, or of docs/training.md for validate; the tiny sizes added)
    (["data", "prepare", "--out", "data_cache/default"], ["--vocab-size", "300", "--val-fraction", "0.1"]),
    (["accounting", "--config", "configs/model/tiny-moe.yaml"], []),
    (["fit", "--config", "configs/experiments/tiny-moe.yaml"], [*TINY, "--trainer.max_steps", "2"]),
    (
        ["validate", "--ckpt_path", CKPT, "--data.data_dir", "data_cache/default"],
        ["--data.val_batches", "1", "--trainer.enable_progress_bar", "false"],
    ),
    (["eval", "--checkpoint", "CK", "--tasks", "moe_lit_suite"], ["--limit", "2", "--bootstrap-iters", "0"]),
    (["generate", "--checkpoint", "CK", "--prompt", "..."], ["--max-new-tokens", "4"]),
    (
        ["fit", "--model", "configs/model/tiny-mixtral.yaml", "--trainer", "configs/trainer/cpu.yaml", "--out"],
        ["runs/tiny-mixtral", *TINY, "--trainer.max_steps", "2"],
    ),
    (
        ["export", "--checkpoint", "runs/tiny-mixtral/checkpoints/last.ckpt", "--format", "mixtral", "--out"],
        ["hf-mixtral"],
    ),
    (["study", "run", "configs/studies/upcycling-e8-e32.yaml"], ["--dry-run"]),
]
TOUR_SCRIPT = """
import json, sys
from moe_lit.console_script import main

codes = []
for argv in json.loads(sys.argv[1]):
    print("== moe-lit", *argv, flush=True)
    print("== moe-lit", *argv, file=sys.stderr, flush=True)
    try:
        codes.append(main(argv))
    except SystemExit as exc:
        codes.append(exc.code)
    if codes[-1] != 0:
        break
print("codes", json.dumps(codes))
"""


def test_the_readme_tour_runs_from_the_installed_wheel_outside_the_checkout(site, tmp_path):
    documented = {c.argv[1:] for c in doc_commands(["README.md", "docs/training.md"]) if c.program == "moe-lit"}
    for words, _ in TOUR:
        assert any(tuple(words) == argv[: len(words)] for argv in documented), f"not in the docs: {words}"
    corpus = write_corpus(tmp_path / "corpus", files=2, paragraphs=40)
    work = tmp_path / "anywhere"
    work.mkdir()
    placeholders = {"CK": CKPT, "...": "ab"}
    steps = [[placeholders.get(word, word) for word in words] + extra for words, extra in TOUR]
    steps[0] += ["--source", str(corpus), "--test-fraction", "0.1", "--quiet"]
    proc = _run([sys.executable, "-c", TOUR_SCRIPT, json.dumps(steps)], site, work, timeout=900)
    codes = json.loads(proc.stdout.rsplit("codes ", 1)[-1]) if "codes " in proc.stdout else []
    assert codes == [0] * len(steps), f"{codes}\n{proc.stderr[-4000:]}"
    # the data went to the working directory's data_cache/default, never into the install
    assert (work / "data_cache" / "default" / "meta.json").is_file() and not (site / "moe_lit" / "data_cache").exists()
    assert f"fit: checkpoint {Path(CKPT)}" in proc.stdout or f"fit: checkpoint {work / CKPT}" in proc.stdout
    assert "val/loss" in proc.stdout and "Items per language: ppl 2" in proc.stdout
    assert (work / "hf-mixtral" / "config.json").is_file() and "up_utility_noise/s0" in proc.stdout
