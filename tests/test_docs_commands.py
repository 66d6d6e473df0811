"""Every command line quoted in README.md, CONTRIBUTING.md and docs/ runs as written, or parses.

Each line (``tests/helpers/doc_commands.py`` reads them) is checked the cheapest way that still fails
on an unknown flag or command:

* **run** (tiny sizes): ``moe-lit`` accounting, fit, validate, generate, analyze text, study list /
  ``run --dry-run`` and ``data prepare`` of a local folder, in document order, in one working
  directory whose ``data_cache/default`` is the shared tiny corpus; placeholders (``CKPT``,
  ``results/demo/models/moe``, ...) name a tiny exported MoE, and tiny sizes are appended (the last
  flag wins). A line that runs exactly as written must print the output its doc shows under it
  (``$ ...`` blocks), an error line included (then with exit status 2).
* **parse**: every other complete ``moe-lit`` line, the benchmarks and ``python -m`` modules: the
  command's own parser reads the words (LightningCLI with ``--print_config``), nothing runs. These
  need a GPU, SLURM, a download, the bundled corpus or minutes of CPU.
* **names**: a synopsis (inline ``moe-lit eval``, ``convert upcycle|expand ...``, ``--tasks ...``)
  names existing commands, subcommands and options.
* make targets: ``make -n``; scripts: shipped (and ``bash -n``); pip extras: in pyproject.toml;
  cd/export/unzip/grep, pip from PyPI, lm-eval's own ``lm_eval``: outside the project, listed.
"""

import argparse
import contextlib
import importlib.util
import io
import json
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import metadata
from pathlib import Path

import pytest
import torch

from moe_lit.console_script import ACTIONS, COMMANDS, EXAMPLES, LIGHTNING_SUBCOMMANDS, main, split_settings
from tests.helpers.corpus import prepare_corpus
from tests.helpers.doc_commands import DOCS, DocCommand, doc_commands
from tests.helpers.paths import REPO

COMMAND_LINES = doc_commands()
EXTERNAL = {
    "cd": "shell",
    "export": "shell",
    "unzip": "shell",
    "grep": "shell",
    "lm_eval": "lm-eval's own CLI, which the doc says cannot see the model",
}
"""Programs outside the project: listed, not run."""
RUNNABLE = {
    ("accounting",),
    ("fit",),
    ("validate",),
    ("generate",),
    ("analyze", "text"),
    ("study", "list"),
    ("study", "run"),  # with --dry-run only
    ("data", "prepare"),  # of a local folder only
}
"""``moe-lit`` commands a doc line of which runs for real at tiny sizes (the others parse)."""
SLOW_WORDS = ("--train.compile",)
"""Words that make a tiny run slow: such a line parses."""
TINY_MODEL = ["--model.model.d_model", "32", "--model.model.n_layers", "2", "--model.model.d_ff", "64"]
TINY_EXPERTS = ["--model.model.moe.num_experts", "4", "--model.model.moe.expert_size", "16"]
TINY_DATA = ["--data.seq_len", "16", "--data.batch_size", "4", "--data.val_batches", "1"]
QUIET_TRAINER = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
MACHINE_PATHS = re.compile(r"^(/work/|/home/|/root/|/Users/)")
RUN_CKPT = re.compile(r"(runs/[\w.-]+)/checkpoints/last\.ckpt")
"""A run's checkpoint that a line uses (``runs/tiny-moe/checkpoints/last.ckpt``)."""


class ParsedOnly(Exception):
    """Raised right after an argparse parser accepted its words, before the command does anything."""


@dataclass
class DocsEnv:
    """The working directory of the runs and what the placeholders name."""

    cwd: Path
    corpus: Path
    prepared: Path
    export: Path
    ran: set[tuple[str, ...]]
    """Words that ran and did what their doc says."""

    def placeholders(self) -> dict[str, str]:
        export = str(self.export)
        return {
            "CK": export,
            "CKPT": export,
            "CKPT_OR_DIR": export,
            "results/demo/models/moe": export,
            "DIR": str(self.prepared),
            "my_corpus/": str(self.corpus),
        }


@pytest.fixture(scope="module")
def docs_env(tmp_path_factory):
    from moe_lit.checkpoint import export_model
    from moe_lit.model import Transformer
    from tests.helpers.models import tiny

    root = tmp_path_factory.mktemp("docs")
    prepared = prepare_corpus(root, paragraphs=40, val_fraction=0.1, test_fraction=0.1)
    vocab = json.loads((prepared / "meta.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    export = export_model(
        Transformer(tiny(vocab_size=vocab, seq_len=32)).eval(), root / "moe", prepared / "tokenizer.json"
    )
    cwd = root / "cwd"
    (cwd / "data_cache").mkdir(parents=True)
    (cwd / "data_cache" / "default").symlink_to(prepared)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        patch.setenv("MOE_LIT_DATA", str(cwd / "data_cache" / "default"))
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        yield DocsEnv(cwd, root / "corpus", prepared, export, set())


def _mode(cmd: DocCommand) -> str:
    """run | parse | names (moe-lit lines), or the program's check."""
    if cmd.program != "moe-lit":
        return cmd.program
    complete_training = len(cmd.argv) > 2 and cmd.argv[1] in LIGHTNING_SUBCOMMANDS and cmd.argv[2].startswith("--")
    if cmd.synopsis and not (cmd.inline and complete_training and "..." not in cmd.argv):
        return "names"
    if cmd.inline:
        return "parse"
    path = tuple(cmd.argv[1:3]) if cmd.argv[1] in ACTIONS else tuple(cmd.argv[1:2])
    runnable = path in RUNNABLE or cmd.argv[1].startswith("-")
    if path == ("study", "run"):
        runnable = "--dry-run" in cmd.argv
    if path == ("data", "prepare"):
        runnable = "--source" in cmd.argv and cmd.argv[cmd.argv.index("--source") + 1].endswith("/")
    if any(word in SLOW_WORDS or word in ("cuda", "~") or word.startswith(("~/", "/tmp/")) for word in cmd.argv):
        runnable = False
    unresolved = [w for w in cmd.argv[2:] if re.fullmatch(r"[A-Z][A-Z0-9_]*", w) and w not in _PLACEHOLDERS]
    return "run" if runnable and not unresolved else "parse"


_PLACEHOLDERS = ("CK", "CKPT", "CKPT_OR_DIR", "DIR")


def _param(cmd: DocCommand):
    slow = _mode(cmd) == "run" and cmd.argv[1] in ("fit", "validate", "data")
    return pytest.param(cmd, id=f"{cmd.where}:{cmd.argv[1] if len(cmd.argv) > 1 else ''}", marks=_slow(slow))


def _slow(slow: bool):
    return [pytest.mark.slow] if slow else []


@pytest.mark.parametrize("cmd", [_param(cmd) for cmd in COMMAND_LINES])
def test_every_documented_command_line_runs_or_parses(cmd, docs_env, capsys, monkeypatch):
    mode = _mode(cmd)
    if mode == "run":
        _run(cmd, docs_env, capsys)
    elif mode == "parse":
        _parse(list(cmd.argv), monkeypatch, capsys)
    elif mode == "names":
        _names(list(cmd.argv), monkeypatch)
    else:
        _check_other(cmd, monkeypatch, capsys)


# ----------------------------------------------------------------------------- moe-lit: run
def _run(cmd: DocCommand, env: DocsEnv, capsys) -> None:
    argv, as_written = _tiny(list(cmd.argv[1:]), env, bool(cmd.output))
    if tuple(argv) in env.ran:  # the same words on another page (README and docs/install.md)
        return
    _train_the_runs_it_uses(cmd, argv, env)
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out, err = capsys.readouterr()
    errors = [line for line in cmd.output if ": error: " in line]
    if errors:
        assert code == 2, f"{cmd}: the doc shows an error, the command exited {code}\n{out}{err}"
    else:
        assert code == 0, f"{cmd}: exit {code}\n{err[-3000:]}"
    if as_written and cmd.output:
        _assert_shows(cmd, (out + err).splitlines())
    env.ran.add(tuple(argv))


def _train_the_runs_it_uses(cmd: DocCommand, argv: list[str], env: DocsEnv) -> None:
    """Train each run whose checkpoint the line uses and no line before it on this worker trained (a line
    run on its own, -k, or on another worker): the page's own fit line into it, else its experiment."""
    used = [match.group(1) for word in argv if (match := RUN_CKPT.fullmatch(word))]
    if argv[0] == "fit" and "--resume" in argv and "--out" in argv:
        used.append(argv[argv.index("--out") + 1])
    page = cmd.where.split(":")[0]
    for run in used:
        if (env.cwd / run / "checkpoints" / "last.ckpt").is_file():
            continue
        fits = [
            list(line.argv[1:])
            for line in COMMAND_LINES
            if line.where.split(":")[0] == page and line.argv[1:2] == ("fit",) and "--resume" not in line.argv
            if run in line.argv and line.argv[line.argv.index(run) - 1] == "--out"
        ]
        words = fits[0] if fits else ["fit", "--config", f"configs/experiments/{Path(run).name}.yaml"]
        assert main([*words, *_fit_sizes(words)]) == 0, f"{cmd}: training {run} first failed"


def _tiny(argv: list[str], env: DocsEnv, output: bool = False) -> tuple[list[str], bool]:
    """The words with placeholders replaced and tiny sizes appended; whether they are the doc's own."""
    names = env.placeholders()
    replaced = [names.get(word, word) for word in argv]
    command = replaced[0]
    if output:  # an example with its output: as written
        extra = []
    elif command == "fit":
        extra = _fit_sizes(replaced)
    elif command == "validate":
        extra = [*TINY_DATA[2:], *QUIET_TRAINER]
    elif command == "generate":
        extra = ["--max-new-tokens", "4"]
    elif command == "data":
        extra = ["--vocab-size", "300", "--val-fraction", "0.1", "--test-fraction", "0.1", "--quiet"]
        extra += ["--out", f"data_cache/doc-{len(list((env.cwd / 'data_cache').iterdir()))}"]
    else:
        extra = []
    if "--help" in replaced:
        extra = []
    return [*replaced, *extra], replaced == argv and not extra


def _fit_sizes(argv: list[str]) -> list[str]:
    """Tiny model, data and step budget for a fit line; a fresh fit replaces an earlier line's run."""
    from moe_lit.checkpoint import load_config
    from moe_lit.resources import packaged_config

    yamls = [packaged_config(w) for flag, w in zip(argv, argv[1:], strict=False) if flag in ("--config", "--model")]
    experts = TINY_EXPERTS if any(load_config(path).is_moe for path in yamls) else []
    resume = "--ckpt_path" in argv or "--resume" in argv
    budget = ["--train.max_tokens", str(2 * 16 * 4)] if "--train.max_tokens" in argv else []
    budget = budget or ["--trainer.max_steps", "3" if resume else "2"]
    if "--trainer.callbacks.at_step" in argv:  # a mid-run callback still acts inside the tiny budget
        budget += ["--trainer.callbacks.at_step", "1"]
    return [*TINY_MODEL, *experts, *TINY_DATA, *QUIET_TRAINER, *budget, *([] if resume else ["--force"])]


def _assert_shows(cmd: DocCommand, printed: list[str]) -> None:
    """Every line the doc shows under the command is printed, in that order."""
    lines = iter(line.rstrip() for line in printed)
    missing = [shown for shown in cmd.output if shown.strip() and shown.rstrip() not in lines]
    assert not missing, f"{cmd}: the doc shows lines it no longer prints:\n" + "\n".join(missing)


# ----------------------------------------------------------------------------- moe-lit: parse
def _parse(argv: list[str], monkeypatch, capsys) -> None:
    """The command's parser takes the words; nothing runs (LightningCLI: --print_config)."""
    words = [word.replace("<run>", "tiny-moe") for word in argv[1:]]
    if words[0] in LIGHTNING_SUBCOMMANDS:
        with contextlib.redirect_stdout(io.StringIO()):
            code = main([*words, "--print_config"])
        assert code == 0, capsys.readouterr().err
        return
    _stop_after_parsing(monkeypatch)
    with pytest.raises((ParsedOnly, SystemExit)) as stopped:
        main(words)
    assert stopped.type is ParsedOnly, f"{shlex_join(argv)}: {capsys.readouterr().err.strip()}"
    if words[0] == "lm-eval":
        assert words[1] in ACTIONS["lm-eval"], f"one written form: moe-lit lm-eval run ..., not {shlex_join(argv)}"


def _stop_after_parsing(monkeypatch) -> None:
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse_args(self, args, namespace)
        raise ParsedOnly

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)


def shlex_join(argv) -> str:
    import shlex

    return shlex.join(argv)


@pytest.mark.parametrize("command", sorted({*LIGHTNING_SUBCOMMANDS, *COMMANDS, *EXAMPLES}))
def test_every_command_help_starts_with_an_example_that_parses(command, monkeypatch, capsys):
    """Each command's ``--help`` (and a subcommand's with a line of its own) starts with its example."""
    from moe_lit.lit import lightning_cli

    words = command.split()
    with monkeypatch.context() as patch:  # Trainer's own help (seconds) follows the example line
        patch.setattr(lightning_cli, "run_lightning_cli", lambda argv: 0)
        with contextlib.suppress(SystemExit):
            main([*words, "--help"])
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"example: {EXAMPLES[command]}"
    argv = shlex.split(EXAMPLES[command])
    assert argv[: len(words) + 1] == ["moe-lit", *words]
    _parse(argv, monkeypatch, capsys)


# ----------------------------------------------------------------------------- moe-lit: names
def _names(argv: list[str], monkeypatch) -> None:
    """A synopsis names a command, its subcommands and options that exist."""
    words = argv[1:]
    if not words or words[0].startswith("-"):
        assert all(word in ("--help", "--version", "-h") for word in words), argv
        return
    command = words[0]
    if command.startswith("<") or command.isupper() or "|" in command:
        alternatives = command.split("|")
        assert command.startswith("<") or command.isupper() or set(alternatives) <= {*LIGHTNING_SUBCOMMANDS}, argv
        return
    assert command in COMMANDS or command in LIGHTNING_SUBCOMMANDS, f"{argv}: no command {command!r}"
    if command in LIGHTNING_SUBCOMMANDS:
        return
    parser = _parser_of(command, monkeypatch)
    rest = words[1:]
    if command in ACTIONS and rest and not rest[0].startswith("-"):
        if rest[0].isupper():
            return
        chosen = rest[0].split("|")
        assert set(chosen) <= set(ACTIONS[command]), f"{argv}: {chosen} not among {ACTIONS[command]}"
        parser = _subparsers(parser)[chosen[0]]
    check_settings = getattr(parser, "check_settings", None)  # lm-eval's own parser has none
    if check_settings is not None:  # --SECTION.FIELD VALUE words: the run YAML's fields
        rest, settings = split_settings(rest)
        check_settings(settings)
    options = {option for action in parser._actions for option in action.option_strings}
    unknown = [w.split("=")[0] for w in rest if w.startswith("--") and w.split("=")[0] not in options]
    assert not unknown, f"{shlex_join(argv)}: unknown options {unknown}"


def _parser_of(command: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser ``moe-lit COMMAND`` builds (lm-eval's own for lm-eval), caught as it parses."""
    caught = []

    def catch(self, args=None, namespace=None):
        caught.append(self)
        raise ParsedOnly

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", catch)
        with pytest.raises(ParsedOnly):
            main([command, "--help"] if command != "lm-eval" else [command, "ls", "tasks"])
    return caught[0]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


# ----------------------------------------------------------------------------- other programs
def _check_other(cmd: DocCommand, monkeypatch, capsys) -> None:
    program, args = cmd.program, list(cmd.argv[1:])
    if program in EXTERNAL:
        return
    if program == "make":
        proc = subprocess.run(["make", "-n", "-C", str(REPO), *args], capture_output=True, text=True)
        assert proc.returncode == 0, f"{cmd}: {proc.stderr.strip()}"
    elif program in ("python", ".venv/bin/python"):
        _check_python(cmd, args, monkeypatch, capsys)
    elif program.startswith(".venv/bin/"):
        assert (REPO / program).is_file() or not (REPO / ".venv").is_dir(), f"{cmd}: {program} is not installed"
    elif program == "pip":
        _check_pip(cmd, args)
    elif program == "bash":
        assert (REPO / args[0]).is_file(), f"{cmd}: no {args[0]}"
        assert subprocess.run(["bash", "-n", str(REPO / args[0])]).returncode == 0
    elif program == "srun":
        _parse(args, monkeypatch, capsys)
    elif program == "torchrun":
        module = args.index("-m")
        assert args[module + 1] == "moe_lit.console_script", cmd
        _parse(["moe-lit", *args[module + 2 :]], monkeypatch, capsys)
    else:
        pytest.fail(f"{cmd}: unknown program {program!r}; say how the docs harness checks it")


def _check_python(cmd: DocCommand, args: list[str], monkeypatch, capsys) -> None:
    if args[0] == "-c":
        compile(args[1], cmd.where, "exec")
        return
    if args[0] != "-m":
        script = REPO / args[0]
        assert script.is_file(), f"{cmd}: no {args[0]}"
        package = ".".join(Path(args[0]).with_suffix("").parts)
        assert not (script.parent / "__init__.py").is_file(), f"{cmd}: a module of a package; run python -m {package}"
        return
    module, words = args[1], args[2:]
    if module == "pytest":
        paths = [w.split("::")[0] for w in words if not w.startswith("-")]
        assert all((REPO / path).exists() for path in paths), f"{cmd}: no such test file"
        return
    assert importlib.util.find_spec(module) is not None, f"{cmd}: no module {module}"
    if cmd.synopsis or not module.startswith(("benchmarks.", "moe_lit.")):
        return
    _stop_after_parsing(monkeypatch)
    monkeypatch.setattr(sys, "argv", [module, *words])
    with pytest.raises((ParsedOnly, SystemExit)) as stopped:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    assert stopped.type is ParsedOnly, f"{cmd}: {capsys.readouterr().err.strip()}"


def _check_pip(cmd: DocCommand, args: list[str]) -> None:
    """The project's own extras (the installed distribution's) and files exist; other packages come from PyPI."""
    extras = metadata("moe_lit").get_all("Provides-Extra") or []
    for word in args:
        named = re.fullmatch(r"(?:\.|moe_lit)\[([\w,]+)\]", word)
        if named:
            assert set(named.group(1).split(",")) <= set(extras), f"{cmd}: no extra {named.group(1)}"
    if "-r" in args:
        assert (REPO / args[args.index("-r") + 1]).is_file(), cmd


# ----------------------------------------------------------------------------- what the docs cite
def test_every_script_and_file_a_doc_cites_is_shipped():
    """A ``.py`` / ``.sh`` path in backticks is a file of the repository (a path ending there)."""
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True, check=True)
    files = tracked.stdout.splitlines()
    missing = []
    for doc in DOCS:
        for cited in re.findall(r"`([\w./<>*-]+\.(?:py|sh))(?:::[^`]*)?`", (REPO / doc).read_text()):
            pattern = re.escape(cited).replace(r"\*", "[^/]*")
            pattern = re.sub(r"<[^>]+>", "[^/]+", pattern.replace(r"\<", "<").replace(r"\>", ">"))
            if not any(re.fullmatch(f"(?:.*/)?{pattern}", path) for path in files):
                missing.append(f"{doc}: {cited}")
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)


def test_no_documented_command_names_a_path_of_one_machine():
    machine = [str(cmd) for cmd in COMMAND_LINES if any(MACHINE_PATHS.match(word) for word in cmd.argv)]
    assert not machine, "use a variable or a relative path:\n" + "\n".join(machine)


def test_the_harness_reads_blocks_continuations_outputs_and_inline_commands(tmp_path, monkeypatch):
    from tests.helpers import doc_commands as reader

    doc = tmp_path / "x.md"
    doc.write_text(
        "Run `moe-lit eval --checkpoint CK` or `export` (a command name).\n\n"
        "```bash\nmoe-lit fit --config a.yaml \\\n    --trainer.max_steps 3   # resume\n"
        "# a comment\nmoe-lit fit --help | grep moe && make demo\n```\n\n"
        "```\n$ moe-lit accounting --config m.yaml\n| name |\n|---|\n$ moe-lit x\n```\n"
    )
    monkeypatch.setattr(reader, "REPO", tmp_path)
    found = [(c.where, c.argv, c.inline, c.output) for c in reader.doc_commands(["x.md"])]
    assert found == [
        ("x.md:1", ("moe-lit", "eval", "--checkpoint", "CK"), True, ()),
        ("x.md:4", ("moe-lit", "fit", "--config", "a.yaml", "--trainer.max_steps", "3"), False, ()),
        ("x.md:7", ("moe-lit", "fit", "--help"), False, ()),
        ("x.md:7", ("grep", "moe"), False, ()),
        ("x.md:7", ("make", "demo"), False, ()),
        ("x.md:11", ("moe-lit", "accounting", "--config", "m.yaml"), False, ("| name |", "|---|")),
        ("x.md:14", ("moe-lit", "x"), False, ()),
    ]


def test_every_moe_lit_command_is_exercised_by_some_line():
    """The harness is no sieve: each command (and subcommand) appears in a doc line it checks."""
    lines = [c.argv for c in COMMAND_LINES if c.program == "moe-lit" and len(c.argv) > 1]
    seen = {(name,) for argv in lines for name in argv[1].split("|")}
    seen |= {
        (argv[1], action) for argv in lines if argv[1] in ACTIONS and len(argv) > 2 for action in argv[2].split("|")
    }
    wanted = {(name,) for name in [*LIGHTNING_SUBCOMMANDS, *COMMANDS]}
    wanted |= {(name, action) for name, actions in ACTIONS.items() for action in actions if name != "lm-eval"}
    wanted -= {("test",), ("lm-eval", "ls"), ("lm-eval", "validate")}
    assert wanted <= seen, f"documented nowhere: {sorted(wanted - seen)}"
