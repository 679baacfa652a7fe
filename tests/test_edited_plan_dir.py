"""A plan directory edited by hand (Note [verified once] in hetc/plandir.py): `hetc verify` reads the listings
and the group table as they are, and what does not describe the plan's ranks is a located error with exit
status 2, never an internal error."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from hetc.cli import main as hetc_main


@pytest.fixture
def plan(demo_plan_dirs, tmp_path) -> Path:
    """A copy of the 4-rank demo pipeline's plan directory, to edit."""
    copy = tmp_path / "plan"
    shutil.copytree(demo_plan_dirs["pp"], copy)
    return copy


def _verify(plan: Path, capsys, *flags: str) -> tuple[int, str]:
    code = hetc_main(["verify", str(plan), *flags])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_peer_outside_the_world_names_its_rank_and_instruction(plan, capsys, backend):
    listing = plan / "programs" / "rank-0002.txt"
    listing.write_text(re.sub(r"from=0 ", "from=4 ", listing.read_text(), count=1))
    code, err = _verify(plan, capsys, "--backend", backend)
    assert code == 2, err
    assert re.search(r"rank 2, instruction \d+ `recv [^`]*from=4[^`]*`: peer rank 4 is not a rank of the program "
                     r"\(0-3\)", err), err


def test_a_group_member_outside_the_world_is_named(plan, capsys):
    groups = plan / "groups.txt"
    groups.write_text(groups.read_text().replace("group dp.s0.p0 = [0, 1]", "group dp.s0.p0 = [0, 7]"))
    code, err = _verify(plan, capsys)
    assert code == 2, err
    assert "group dp.s0.p0 names rank 7, but the program has ranks 0-3" in err, err


@pytest.mark.parametrize("name", ["groups.txt", "programs/rank-0001.txt"])
def test_bytes_that_are_not_utf8_are_an_error_at_their_line(plan, capsys, name):
    path = plan / name
    lines = path.read_bytes().split(b"\n")
    lines[1] = lines[1][:5] + b"\xe0" + lines[1][5:]
    path.write_bytes(b"\n".join(lines))
    code, err = _verify(plan, capsys)
    assert code == 2, err
    assert f"{path}:2: error: the file is not UTF-8 text" in err, err


@pytest.mark.parametrize("garbage", [b'{\n "profiles": [\xd0]}\n', b'{"profiles": 3}', b"[]"])
def test_a_broken_profiles_record_names_the_file(plan, capsys, garbage):
    (plan / "profiles.json").write_bytes(garbage)
    code = hetc_main(["viz", str(plan), "-o", str(plan.parent / "schedule.html")])
    assert code == 2
    assert f"{plan / 'profiles.json'}: not a profiles record" in capsys.readouterr().err


def test_a_listing_without_a_ministages_buffer_line_is_refused(plan, capsys):
    listing = plan / "programs" / "rank-0001.txt"
    listing.write_text("\n".join(line for line in listing.read_text().split("\n") if not line.startswith("shard ")))
    code, err = _verify(plan, capsys)
    assert code == 2, err
    assert "rank 1: the buffer table has `shard` lines for ministages none, but stage 0 runs ministages [0]" in err


def test_a_copied_plan_without_its_data_says_where_it_looked(demo_plan_dirs, tmp_path, capsys, monkeypatch):
    """plan.het names its data relative to the plan directory (hetc/plandir.py `portable_spec`): a copy at
    another depth, without the data, names the folder it read from, not only the path as written."""
    copy = tmp_path / "shared" / "plans" / "deep" / "pp"
    shutil.copytree(demo_plan_dirs["pp"], copy)
    monkeypatch.chdir(tmp_path)
    code = hetc_main(["check", str(copy / "plan.het")])
    err = capsys.readouterr().err
    written = re.search(r'path = "([^"]+)"', (copy / "plan.het").read_text())
    assert written is not None
    looked = (copy / written[1]).resolve()
    assert code == 2, err
    assert f"cannot find the text file '{written[1]}' (a relative path is read from the spec's folder: here " \
           f"{looked})" in err, err
