from moe_lit.cli import COMMANDS, main


def test_top_level_help_is_plain_text_listing_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":class:" not in out  # no RST from a docstring
    assert all(name in out for name in COMMANDS)


def test_unknown_command_is_one_line_with_exit_2(capsys):
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown command 'frobnicate'" in err[0]
