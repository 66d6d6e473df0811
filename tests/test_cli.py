"""The ``moe-lit`` console script: version, help text of every flag, defaults shown, device defaults."""

import argparse
import importlib
from importlib.metadata import version

import pytest

from moe_lit.console_script import COMMANDS, PASSTHROUGH_COMMANDS, ArgumentParser, main

OWN_COMMANDS = [name for name in COMMANDS if name not in PASSTHROUGH_COMMANDS]


def command_parsers(name: str):
    """``(prog, parser)`` of a command and of each of its subcommands."""
    parser = ArgumentParser(prog=f"moe-lit {name}")
    importlib.import_module(COMMANDS[name][0]).configure(parser)
    found, todo = [], [parser]
    while todo:
        current = todo.pop()
        found.append(current)
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return found


def test_version_is_the_installed_distributions(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"moe-lit {version('moe_lit')}"


def test_top_level_help_is_plain_text_listing_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":class:" not in out  # no RST from a docstring
    assert "--version" in out and all(name in out for name in COMMANDS)


def test_unknown_command_is_one_line_with_exit_2(capsys):
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown command 'frobnicate'" in err[0]


@pytest.mark.parametrize("name", OWN_COMMANDS)
def test_every_flag_has_help_text_and_every_device_defaults_to_auto(name):
    for parser in command_parsers(name):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"{parser.prog} {action.option_strings or action.dest}: no help text"
            if action.dest == "device":
                assert action.default == "auto", parser.prog


def test_help_shows_defaults_but_not_empty_ones(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: auto)" in out and "(default: 8)" in out  # --device, --batch-size
    assert "(default: None)" not in out and "(default: False)" not in out and "(default: [])" not in out
    with pytest.raises(SystemExit):
        main(["convert", "upcycle", "--help"])
    assert "(default: 0)" in " ".join(capsys.readouterr().out.split())  # --seed 0 is shown


def test_top_level_help_names_every_subcommand_of_every_command(capsys):
    from moe_lit.console_script import ACTIONS

    for name in OWN_COMMANDS:
        parser = ArgumentParser(prog=f"moe-lit {name}")
        importlib.import_module(COMMANDS[name][0]).configure(parser)
        found = [a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        assert (tuple(found[0]) if found else ()) == ACTIONS.get(name, ()), name
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert all(" | ".join(actions) in out for actions in ACTIONS.values())
    assert "routing | text" in out  # analyze text is listed


@pytest.mark.parametrize(
    "argv, unknown",
    [
        (["generate", "--checkpoint", "x", "--prompt", "a", "--max-new", "3"], "--max-new"),
        (["convert", "prune", "--checkpoint", "x", "--fract", "0.5", "--out", "y"], "--fract"),
        (["fit", "--train.max_step", "7", "--print_config"], "train.max_step: unknown key"),
    ],
)
def test_no_command_takes_an_abbreviated_option(capsys, argv, unknown):
    code = main(argv) if argv[0] == "fit" else None
    if code is None:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        code = exc.value.code
    assert code == 2 and unknown in capsys.readouterr().err


def test_an_error_names_the_full_subcommand(capsys, tmp_path):
    assert main(["convert", "expand", "--checkpoint", str(tmp_path / "nope"), "--factor", "2", "--out", "o"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("moe-lit convert expand: error: ") and "nope" in line
