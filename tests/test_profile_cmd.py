"""`hetc profile`: a short CPU run writes a profile that `hetc explain` reads."""

from __future__ import annotations

import json

import pytest

from hetc.cli import main
from hetc.passes.cost import ProfileError, load_profiles
from hetc.passes.cost.sources.hetc_profile import FORMAT, VERSION, profile_from_dict
from tests.conftest import DEMO

pytestmark = pytest.mark.slow


def test_short_cpu_run_feeds_explain(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    assert main(["profile", str(DEMO / "job.het"), "-o", str(out), "--micro-batches", "1,2", "--repeats", "2",
                 "--comm-sizes", "65536"]) == 0
    assert "wrote" in capsys.readouterr().err                 # the progress line
    data = json.loads(out.read_text())
    assert data["format"] == FORMAT and data["version"] == VERSION and data["device"]["kind"] == "cpu"
    layers = {(r["layer"], r["micro_batch"]) for r in data["layers"]}
    assert layers == {(k, b) for k in ("embed", "block", "head") for b in (1, 2)}
    assert all(r["forward_s"] > 0 and r["backward_s"] > 0 for r in data["layers"])
    assert {r["kind"] for r in data["collectives"]} >= {"all_reduce", "all_gather"}
    assert data["p2p"] and data["copy"]
    # the demo cluster's four cpu ranks run here at once: the layers were timed four at a time too
    assert data["concurrency"]["ranks"] == 4 and data["concurrency"]["cores"] >= 1
    assert data["concurrency"]["slowdown"] > 0
    # and timed a blocking call's wait for a core with four processes computing beside the calls
    wait = data["core_wait"]
    assert wait["ranks"] == 4 and wait["calls"] == 8 * 2 and wait["collective_s"] >= 0 and wait["p2p_s"] >= 0 \
        and wait["exchange_s"] >= 0 and wait["world_collective_s"] >= 0

    profiles = load_profiles([out])
    assert profiles.network.intra_rate("cpu", 2) is not None and profiles.copy["cpu"] > 0
    assert profiles.core_wait["cpu"].ranks == 4
    assert main(["explain", str(DEMO / "pp.het"), "--json", "--profile", str(out)]) == 0
    explained = json.loads(capsys.readouterr().out)
    assert explained["sources"]
    assert all(str(out) in s for srcs in explained["sources"].values() for s in srcs)


def test_profile_format_is_checked():
    with pytest.raises(ProfileError, match="version 2"):
        profile_from_dict({"format": FORMAT, "version": 2}, "p.json")
    with pytest.raises(ProfileError, match="malformed"):
        profile_from_dict({"format": FORMAT, "version": VERSION, "device": {}}, "p.json")


def test_bad_flags(capsys):
    assert main(["profile", "--micro-batches", "x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert main(["profile", "--hidden", "30", "--heads", "4"]) == 2


def test_a_loaded_machine_is_named_in_a_warning(monkeypatch, capsys):
    from hetc.commands import profile

    monkeypatch.setattr(profile.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    profile._warn_if_loaded(0.0)
    assert capsys.readouterr().err == ""
    profile._warn_if_loaded(1e6)
    assert "load average reached 1000000.0" in capsys.readouterr().err


def test_a_host_that_took_the_cpus_is_named_in_a_warning(capsys):
    """Steal time (runtime/host_load.py): the share of the CPUs' time between two /proc/stat samples that
    the hypervisor gave to other machines, and `hetc profile` warns above 5 %."""
    from hetc.commands import profile
    from hetc.runtime.host_load import steal_share

    before = [100, 0, 50, 800, 0, 0, 0, 50, 0, 0]
    after = [300, 0, 100, 900, 0, 0, 0, 150, 0, 0]    # 450 ticks passed, 100 of them stolen
    assert steal_share(before, after) == pytest.approx(100 / 450)
    assert steal_share(None, after) is None and steal_share(before, before) is None
    profile._warn_if_stolen(0.01)
    assert capsys.readouterr().err == ""
    profile._warn_if_stolen(steal_share(before, after))
    assert "the host took 22% of this virtual machine's CPU time" in capsys.readouterr().err
