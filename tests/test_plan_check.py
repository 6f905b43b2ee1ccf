"""``hpcjobs plan-check``: each row's flags go through ``hpcjobs plan`` and
come back as the same efficiency plan prints; the shipped published rows are
the ones docs/results/planner.md (c) reports, with the same figures; bad
rows are refused with their line."""

import json
import re
from pathlib import Path

import pytest

from launch import hpcjobs

ROOT = Path(__file__).resolve().parents[1]
HEADER = "id,run,devices,published,source,flags\n"
FLAGS = "--params 25.6M --throughput 400 --batch-per-device 64 --devices-per-node 8 --intra-bw 100 --inter-bw 10 " \
        "--algorithm ring --fusion-bytes 64M"


def test_each_rows_prediction_is_plans_efficiency_at_its_device_count(tmp_path):
    rows = tmp_path / "rows.csv"
    rows.write_text("# a comment\n" + HEADER + f'x1,one node,8,0.95,"a source, with a comma",{FLAGS}\n'
                    f"x2,four nodes,32,0.5,src,{FLAGS}\n\n")
    out = tmp_path / "check.json"
    r = hpcjobs("plan-check", str(rows), "--within", "5", "--json", str(out))
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    plan_json = tmp_path / "plan.json"
    p = hpcjobs("plan", *FLAGS.split(), "--devices", "8,32", "--json", str(plan_json))
    assert p.returncode == 0, p.stderr
    want = {row["devices"]: row["efficiency"] for row in json.loads(plan_json.read_text())["rows"]}
    assert [row["id"] for row in got["rows"]] == ["x1", "x2"]
    for row, published in zip(got["rows"], (0.95, 0.5)):
        assert row["predicted"] == pytest.approx(want[row["devices"]], rel=1e-12)
        assert row["difference_points"] == pytest.approx(100 * (want[row["devices"]] - published), rel=1e-9)
    assert got["rows"][0]["source"] == "a source, with a comma"
    inside = [abs(row["difference_points"]) <= 5 for row in got["rows"]]
    assert got["within"] == sum(inside) and inside == [True, False]  # 8 GPUs at 400/s hide 100 MB; 32 do not 0.5
    assert f"# within 5 points: {sum(inside)} of 2" in r.stdout and "| x2 " in r.stdout


def _doc_rows(ids: str = r"[A-D]\d+[a-z]*") -> dict:
    text = (ROOT / "docs/results/planner.md").read_text()
    section = text[text.index("## (c)"):text.index("## The gradient noise scale")]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and re.fullmatch(ids, cells[0]):
            rows[cells[0]] = (int(cells[2]), cells[3], cells[4], cells[5].replace("−", "-"))
    return rows, section


def _printed(stdout: str) -> dict:
    printed = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0] != "id":
            printed[cells[0]] = (int(cells[2]), cells[3], cells[4], cells[5])
    return printed


def test_the_shipped_published_rows_are_the_ones_the_results_report():
    r = hpcjobs("plan-check")
    assert r.returncode == 0, r.stderr
    doc, section = _doc_rows()
    printed = _printed(r.stdout)
    assert len(printed) >= 30 and printed == doc  # the docs' table is this command's, figure for figure
    summary = re.search(r"# within 7 points: (\d+) of (\d+)", r.stdout)
    assert f"**{summary[1]} of {summary[2]} are within 7 points**" in section


def test_the_held_out_rows_are_the_ones_the_results_report():
    r = hpcjobs("plan-check", "--shipped", "heldout")
    assert r.returncode == 0, r.stderr
    doc, section = _doc_rows(r"H\d+")
    printed = _printed(r.stdout)
    assert len(printed) >= 100 and printed == doc
    within, total = re.search(r"# within 7 points: (\d+) of (\d+)", r.stdout).groups()
    above = re.search(r"predicted above published in (\d+)", r.stdout)[1]
    assert f"| all {total} | **{within}** | {above} |" in section
    assert f"**{within} of {total} within 7 points" in section
    summary = " ".join((ROOT / "docs/results/planner.md").read_text().split())
    assert f"nodes): {within} within 7 points" in summary
    both = list(doc.values()) + list(_doc_rows()[0].values())  # the held-out rows and the 31
    under = sum(v[3].startswith("-") for v in both)
    assert f"published efficiency on {under} of the {len(both)} rows" in " ".join(section.split())


def test_a_file_and_a_shipped_set_together_are_refused(tmp_path):
    rows = tmp_path / "rows.csv"
    rows.write_text(HEADER + f"x,y,8,0.9,s,{FLAGS}\n")
    r = hpcjobs("plan-check", str(rows), "--shipped", "heldout")
    assert r.returncode == 2 and "not both" in r.stderr


@pytest.mark.parametrize("text,words", [
    ("id,run,devices\nx,y,1\n", "expected the columns"),
    (HEADER + "x,y,0,0.9,s,--params 1M --throughput 10\n", "devices must be a positive count"),
    (HEADER + "x,y,2,0.9,s,--params 1M --throughput 10,extra\n", "rows.csv:2: 7 fields"),
    (HEADER + "x,y,2,0.9,s,--params 1M --throughput 10 --devices 4\n", "--devices is not a hardware description"),
    (HEADER + "x,y,2,0.9,s,--params 1M --throughput 10 --inter-bw 1 --against p2.jsonl\n",
     "--against is not a hardware description"),
    (HEADER + "x,y,2,0.9,s,--params 1M --throughput 10 --inter-bw 1 --bogus 3\n", "(x): unrecognized arguments"),
    (HEADER + "x,y,8,0.9,s,--params 1M --throughput 10 --devices-per-node 4\n", "give --intra-bw"),
    (HEADER, "a header and no rows"),
    (HEADER + "x,y,2,0.9,s,--params 1M --throughput 10 --inter-bw 1 --plo /x.png\n", "unrecognized arguments: --plo"),
    (HEADER + "x,y,2,0.9,s,--params 1M --throughput 10 --inter-bw 1 --run /x.jsonl\n", "unrecognized arguments"),
    (HEADER + 'x,y,2,0.9,"s,--params 1M\n', "rows.csv:2"),
])
def test_bad_rows_are_refused_with_their_line(tmp_path, text, words):
    rows = tmp_path / "rows.csv"
    rows.write_text(text)
    r = hpcjobs("plan-check", str(rows))
    assert r.returncode == 2 and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_csv_as_spreadsheets_write_it(tmp_path):
    """A byte-order mark, an indented comment, a quoted field over two lines,
    and the rows of only commas a spreadsheet leaves below its data."""
    rows = tmp_path / "rows.csv"
    rows.write_bytes(("\ufeff" + HEADER + "  # indented comment\n"
                      f'x1,one node,8,0.95,"a source\nover two lines",{FLAGS}\n'
                      f"x2,again,8,0.9,src,{FLAGS}\n,,,,,\n , ,,,,\n").encode("utf-8"))
    r = hpcjobs("plan-check", str(rows))
    assert r.returncode == 0, r.stderr
    assert "| x1 " in r.stdout and "| x2 " in r.stdout and "of 2" in r.stdout


def test_a_relative_cost_model_is_read_beside_the_rows(tmp_path):
    from hpcjobs.machine import Machine

    sizes = [1024, 1 << 20, 16 << 20]
    net = Machine(5e-5, 1e-8, 8e-9, 1e-11, "float32", sizes, [5e-5 + n * 1e-8 for n in sizes],
                  [5e-5 + n * 8e-9 for n in sizes], [n * 1e-11 for n in sizes])
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "model.json").write_text(json.dumps({"ranks": 2, "machine": net.to_dict(), "rows": []}))
    flags = "--params 1M --throughput 100 --batch-per-device 10 --devices-per-node 2 --cost-model model.json " \
            "--algorithm ring"
    (tmp_path / "rows" / "rows.csv").write_text(HEADER + f"x,two hosts,2,0.5,src,{flags}\n")
    out = tmp_path / "check.json"
    r = hpcjobs("plan-check", str(tmp_path / "rows" / "rows.csv"), "--json", str(out))  # run from elsewhere
    assert r.returncode == 0, r.stderr
    plan_json = tmp_path / "plan.json"
    p = hpcjobs("plan", *flags.replace("model.json", str(tmp_path / "rows" / "model.json")).split(),
                "--devices", "2", "--json", str(plan_json))
    assert p.returncode == 0, p.stderr
    want = json.loads(plan_json.read_text())["rows"][0]["efficiency"]
    assert json.loads(out.read_text())["rows"][0]["predicted"] == pytest.approx(want, rel=1e-12)


def test_the_tcp_rows_at_a_measured_rate_are_the_ones_the_results_report(tmp_path):
    """planner.md (c) reruns the TCP rows at 54% and 60% of their line rate
    with a grep and a sed; the same substitution here gives its table."""
    _, section = _doc_rows()
    tcp = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"A\d[a-c]?t? .*", cells[0]):
            tcp[cells[0].split()[0]] = [c.replace("−", "-") for c in cells[1:]]
    assert len(tcp) == 6
    shipped = (ROOT / "hpcjobs/data/published_scaling.csv").read_text().splitlines()
    keep = [line for line in shipped if re.match(r"^(id,|A[0-9][a-c]?t?,[^,]* TCP )", line)]
    for column, (a, b) in enumerate([("25", "40"), ("13.5", "21.6"), ("15", "24")]):
        rows = tmp_path / f"tcp{column}.csv"
        rows.write_text("\n".join(line.replace("--inter-bw 25 ", f"--inter-bw {a} ")
                                   .replace("--inter-bw 40 ", f"--inter-bw {b} ") for line in keep) + "\n")
        out = tmp_path / f"tcp{column}.json"
        r = hpcjobs("plan-check", str(rows), "--json", str(out))
        assert r.returncode == 0, r.stderr
        got = {row["id"]: f"{row['difference_points']:+.2f}" for row in json.loads(out.read_text())["rows"]}
        assert got == {k: v[column] for k, v in tcp.items()}
        assert sum(abs(float(v)) <= 7 for v in got.values()) == (1 if column == 0 else 4)  # as the text says


def test_the_counts_in_the_docs_are_the_commands():
    r = hpcjobs("plan-check")
    within, total = re.search(r"# within 7 points: (\d+) of (\d+)", r.stdout).groups()
    above = re.search(r"predicted above published in (\d+)", r.stdout)[1]
    summary = (ROOT / "docs/results/planner.md").read_text()
    assert f"it matches {within} of {total} efficiencies within 7 points" in summary
    assert f"optimistic\n  on {above} of the {total}" in summary
    training = " ".join((ROOT / "docs/training.md").read_text().split())
    assert f"within 7 points of {within} of {total} published efficiencies, optimistic on {above}" in training


def test_a_missing_file_and_a_folder_for_json_are_refused(tmp_path):
    r = hpcjobs("plan-check", "/nonexistent/rows.csv")
    assert r.returncode == 2 and "cannot read it" in r.stderr and "Traceback" not in r.stderr
    r = hpcjobs("plan-check", "--json", str(tmp_path))
    assert r.returncode == 2 and "is a directory" in r.stderr and "| A1 " not in r.stdout
