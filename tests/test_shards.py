"""Sharded runs and their merge (conformance.output.shards, issue 26): `rosetta check --shard I/N` runs a
deterministic slice of the columns, `rosetta merge` puts the slices back together, equal cell for
cell to the unsharded run; disagreeing duplicates are flagged and reports of other weights refused."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.harness import Plan
from conformance.output.shards import MergeError, merge_reports, parse_shard, read_reports, shard_plan
from rosetta.main import main
from spec import get_preset

CHECK = ["check", "--preset", "tiny", "--backends", "numpy-float32,torch", "--dtypes", "float32,float64,float16",
         "-k", "forward", "--quiet", "--jobs", "1"]


def _cells(report_folder):
    report = json.loads((report_folder / "report.json").read_text())
    return {(c["backend"], c["device"], c["dtype"], c["sublayer"], c["mask_case"]): (c["status"], c["max_abs_err"],
                                                                                     c["tol"])
            for c in report["cells"]}, report


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    assert main([*CHECK, "--report", str(root / "all")]) == 0
    for index in (1, 2, 3):
        assert main([*CHECK, "--shard", f"{index}/3", "--report", str(root / f"shard-{index}")]) in (0, 1)
    return root


def test_shards_merged_are_the_unsharded_run(runs, capsys):
    folders = [runs / f"shard-{index}" for index in (1, 2, 3)]
    assert main(["merge", *map(str, folders), "--out", str(runs / "merged")]) == 0
    merged, report = _cells(runs / "merged")
    unsharded, _ = _cells(runs / "all")
    assert merged == unsharded and len(merged) > 10
    assert report["passed"] and report["conflicts"] == [] and report["machine"] is None
    assert {source["shard"] for source in report["merged_from"]} == {"1/3", "2/3", "3/3"}
    assert set(report["columns"].values()) <= set(map(str, folders))
    shard_columns = [{f"{c[0]}/{c[2]}/{c[1]}" for c in _cells(folder)[0]} for folder in folders]
    assert all(a.isdisjoint(b) for i, a in enumerate(shard_columns) for b in shard_columns[i + 1:])
    assert "from 3 reports" in capsys.readouterr().out


def test_a_shard_records_its_machine_and_slice(runs):
    _, report = _cells(runs / "shard-2")
    assert report["source"]["shard"] == "2/3" and report["machine"]["hostname"]
    assert report["project_version"] is not None


def test_the_same_report_twice_merges_without_conflict(runs):
    merged = merge_reports(*read_reports([runs / "shard-1", runs / "shard-1"]))
    assert merged["conflicts"] == [] and len(merged["cells"]) == len(_cells(runs / "shard-1")[0])


def test_disagreeing_duplicates_are_flagged_and_fail_the_merge(runs, tmp_path, capsys):
    tampered = tmp_path / "tampered"
    shutil.copytree(runs / "shard-2", tampered)
    report = json.loads((tampered / "report.json").read_text())
    cell = next(c for c in json.loads((runs / "shard-1" / "report.json").read_text())["cells"] if c["status"] == "pass")
    report["cells"].append({**cell, "status": "fail", "passed": False, "max_abs_err": 1.0})
    (tampered / "report.json").write_text(json.dumps(report))
    assert main(["merge", str(runs / "shard-1"), str(tampered), "--out", str(tmp_path / "merged")]) == 1
    assert "CONFLICT" in capsys.readouterr().out
    merged = json.loads((tmp_path / "merged" / "report.json").read_text())
    assert not merged["passed"] and len(merged["conflicts"]) == 1
    assert "Conflicting cells" in (tmp_path / "merged" / "report.md").read_text()


@pytest.mark.parametrize("field, value, message", [
    ("params_sha256", "0" * 64, "params_sha256 differs"),
    ("spec_version", "0.0", "spec_version differs"),
    ("project_version", "9.9.9", "project_version differs"),
])
def test_reports_of_another_check_are_refused(runs, tmp_path, capsys, field, value, message):
    other = tmp_path / "other"
    shutil.copytree(runs / "shard-2", other)
    report = json.loads((other / "report.json").read_text())
    report[field] = value
    (other / "report.json").write_text(json.dumps(report))
    assert main(["merge", str(runs / "shard-1"), str(other), "--out", str(tmp_path / "merged")]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(MergeError, match=message):
        merge_reports(*read_reports([runs / "shard-1", other]))


def test_a_folder_without_a_report_is_named(tmp_path):
    with pytest.raises(MergeError, match="no report.json there"):
        read_reports([tmp_path])


@pytest.mark.parametrize("text", ["3", "0/2", "3/2", "a/b", "1/2/3"])
def test_a_bad_shard_is_a_usage_error(text, capsys):
    assert main(["check", "--preset", "tiny", "--shard", text]) == 2
    assert "--shard" in capsys.readouterr().err
    with pytest.raises(ValueError):
        parse_shard(text)


@given(st.integers(1, 6), st.lists(st.sampled_from(["numpy-float32", "torch", "jax", "onnx"]), min_size=1,
                                   max_size=4, unique=True))
def test_the_shards_partition_the_plan(count, backends):
    columns = [(b, dtype, "cpu") for b in backends for dtype in ("float32", "float16")]
    plan = Plan(get_preset("tiny"), columns[1:], {columns[0]: "not here"})
    shards = [shard_plan(plan, index, count) for index in range(1, count + 1)]
    runnable = [c for shard in shards for c in shard.columns]
    assert sorted(runnable) == sorted(plan.columns)  # each column once
    skipped = [c for shard in shards for c in shard.skipped_columns]
    assert skipped == [columns[0]]
    sizes = [len(s.columns) + len(s.skipped_columns) for s in shards]
    assert max(sizes) - min(sizes) <= 1  # every N-th column: balanced
