"""``moe-lit study``: a record that is there but unreadable is one line naming it."""

from moe_lit.console_script import main
from moe_lit.studies.study import parse_study, run_study
from tests.helpers.studies import small_spec
from tests.studies import fakes


def test_a_corrupt_record_is_one_line_naming_it_and_the_report_stays(tmp_path, capsys):
    run_study(
        parse_study(small_spec(ablations=None)), tmp_path, train_fn=fakes.fake_train, prepare_data=False, log=print
    )
    assert main(["study", "report", "--out", str(tmp_path)]) == 0
    summary = (tmp_path / "summary.md").read_text()
    record = sorted((tmp_path / "runs").glob("*.json"))[2]
    record.write_text(record.read_text()[:40])  # cut short
    capsys.readouterr()
    assert main(["study", "report", "--out", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"moe-lit study report: error: {record}: not a readable study record (")
    assert line.endswith("restore it, or delete it and rerun moe-lit study run to train that point again")
    assert (tmp_path / "summary.md").read_text() == summary
