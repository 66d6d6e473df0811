"""Records carried over to their points' new hashes (moe_lit.studies.rehash), on a made-up study of
a parent and two children forking from it, whose points change hash between two plans."""

import json

import pytest

from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_write_json
from moe_lit.lit.run_config import RunConfig
from moe_lit.studies.identity import STUDY_FILE, Point, Start, finalize, fork_checkpoint, point_record, record_path
from moe_lit.studies.rehash import hash_map, rehash_results
from moe_lit.studies.schedule import run_points
from tests.helpers.models import tiny
from tests.studies import fakes


def _plan(val_every: int) -> list[Point]:
    """The study's points; ``val_every`` stands for any change of what their hashes cover."""
    run = RunConfig(data={"seq_len": 16, "batch_size": 4}, train={"max_steps": 4, "val_every": val_every})
    parent = Point("parent", "parent", 0, tiny(), run)
    kids = [Point(f"kid{i}", f"kid{i}", 0, tiny(), run, start=Start("parent", step=2 * i)) for i in (1, 2)]
    return finalize([parent, *kids])


def _finished(out, points) -> dict:
    """The study run with the fake trainer: its plan, records, a runs.csv naming the run folders."""
    atomic_write_json(out / STUDY_FILE, {"name": "t", "points": [point_record(p) for p in points]})
    run_points(points, out, train_fn=fakes.fake_train, log=lambda _: None)
    (out / "runs.csv").write_text("".join(f"{p.name},{p.hash},runs/{p.hash}/metrics.csv\n" for p in points))
    return {p.name: json.loads(record_path(out, p).read_text()) for p in points}


def _files(out) -> dict:
    return {str(f.relative_to(out)): f.read_bytes() for f in sorted(out.rglob("*")) if f.is_file()}


def test_records_move_to_the_new_hash_of_their_point_and_nothing_runs_again(tmp_path):
    old, new = _plan(val_every=2), _plan(val_every=4)
    assert {p.name: p.hash for p in old}.keys() == {p.name: p.hash for p in new}.keys()
    assert not {p.hash for p in old} & {p.hash for p in new}
    records = _finished(tmp_path, old)
    changed = rehash_results(tmp_path, new)
    assert changed == {o.hash: n.hash for o, n in zip(old, new, strict=True)}
    for point in new:  # the same record, its hash replaced
        record = json.loads(record_path(tmp_path, point).read_text())
        assert record == {**records[point.name], "hash": point.hash}
    assert sorted(f.stem for f in (tmp_path / "runs").glob("*.json")) == sorted(p.hash for p in new)
    plan = json.loads((tmp_path / STUDY_FILE).read_text())
    assert [p["hash"] for p in plan["points"]] == [p.hash for p in new]
    assert (tmp_path / "runs.csv").read_text().splitlines()[0] == f"parent,{new[0].hash},runs/{new[0].hash}/metrics.csv"
    assert fork_checkpoint(tmp_path, new[0], 2).is_file()  # the parent's run folder moved with it
    log = []
    run_points(new, tmp_path, train_fn=fakes.fake_train, log=log.append)
    assert log[0].endswith("3 points, 3 finished, 0 to run -> " + str(tmp_path))
    assert len(fakes.read_calls(tmp_path)) == 3  # the first run's calls only


def test_a_second_migration_changes_nothing(tmp_path):
    _finished(tmp_path, _plan(val_every=2))
    new = _plan(val_every=4)
    rehash_results(tmp_path, new)
    before = _files(tmp_path)
    assert rehash_results(tmp_path, new) == {}
    assert _files(tmp_path) == before


def _old(config_name: str, digit: str) -> dict:
    """A point of an old study.json or record (its name can be another: an upcycling arm's own name)."""
    return {"name": "arm", "config_name": config_name, "seed": 0, "hash": digit * 12}


def test_the_map_places_every_record_by_its_point_and_refuses_one_it_cannot_place_or_two_of_one_point():
    new = _plan(val_every=4)
    planned = [_old("parent", "a"), _old("kid1", "b")]
    assert hash_map(new, planned, {"a" * 12: planned[0]}) == {"a" * 12: new[0].hash, "b" * 12: new[1].hash}
    late = _old("kid2", "c")  # written after study.json: placed by its own fields
    assert hash_map(new, planned, {"c" * 12: late})["c" * 12] == new[2].hash
    with pytest.raises(MoeLitError, match=r"points kid3 \(seed 0\): recorded or planned here but not in the study's"):
        hash_map(new, planned, {"d" * 12: _old("kid3", "d")})
    with pytest.raises(MoeLitError, match=f"two records map to one point: {new[0].hash}"):
        hash_map(new, planned, {"a" * 12: planned[0], "e" * 12: _old("parent", "e")})
