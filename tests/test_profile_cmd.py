"""`hetc profile`: a short CPU run writes a profile that `hetc explain` reads."""

from __future__ import annotations

import json

import pytest

from hetc.cli import main
from hetc.passes.cost import ProfileError
from hetc.passes.cost.sources import load_profiles
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


@pytest.mark.parametrize("flags, says", [
    (["--micro-batches", "x"], "--micro-batches must be comma-separated integers, got 'x'"),
    (["--hidden", "30", "--heads", "4"], "hidden (30) is not divisible by heads (4)"),
    # the bounds and rules of a spec's model block, as the front end and the checker hold them
    (["--heads", "0"], "--heads must be between 1 and 16,384, got 0"),
    (["--seq", "0"], "--seq must be between 1 and 16,777,216, got 0"),
    (["--kv-heads", "3"], "heads (4) is not divisible by kv_heads (3)"),
    (["--hidden", "12", "--heads", "4"], "must be even for rotary embeddings"),
    (["--ranks-at-once", "99999999999"], "--ranks-at-once must be between 1 and 1,024, got 99999999999"),
    (["--ranks", "5000"], "--ranks must be between 1 and 1,024, got 5000"),
])
def test_bad_flags(capsys, flags, says):
    assert main(["profile", *flags]) == 2
    assert says in capsys.readouterr().err


def test_a_shape_this_machine_cannot_hold_is_a_usage_error(tmp_path, monkeypatch, capsys):
    from hetc.runtime import measure

    def out_of_memory(*_args, **_kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(measure, "time_layers", out_of_memory)
    assert main(["profile", "-o", str(tmp_path / "p.json"), "--no-comm"]) == 2
    assert "this machine ran out of memory measuring (starting): measure smaller shapes" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


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


# ---------------------------------------------------------------- issue 29, finding 7: only what was measured


def test_a_machine_measures_only_what_it_has_a_gpu_for():
    """Note [Only what was measured] in runtime/measure.py: NCCL between processes with a GPU each, layers at
    once one process per GPU; the rest is skipped with a reason. A CPU machine measures everything."""
    from hetc.runtime.measure import measurable

    one_gpu = measurable(gpus=1, ranks=2, at_once=8)
    assert (one_gpu.layers_at_once, one_gpu.comm_at_once) == (1, None)
    assert [line.split(":")[0] for line in one_gpu.skipped] == [
        "the layers in 8 processes at once", "collectives and point-to-point between 2 processes"]
    assert "this machine has 1" in one_gpu.skipped[1] and "from the catalog" in one_gpu.skipped[1]
    four = measurable(gpus=4, ranks=2, at_once=8)     # pairs fit, eight at once do not
    assert (four.layers_at_once, four.comm_at_once) == (1, 1) and len(four.skipped) == 2
    assert measurable(gpus=8, ranks=2, at_once=8) == measurable(gpus=0, ranks=2, at_once=8)
    assert measurable(gpus=8, ranks=2, at_once=8).skipped == ()
    assert measurable(gpus=1, ranks=2, at_once=1, comm=False).skipped == ()     # --no-comm asks for nothing


def test_a_one_gpu_profile_leaves_out_what_it_could_not_measure(tmp_path, monkeypatch, capsys):
    """`hetc profile --ranks 2` on a machine with one H200 (its measurements stubbed): no gloo rate on CPU
    tensors recorded as the H200's interconnect, no time-slicing as a node's ranks at once; the file says
    what it left out, and the cost model takes those rates from the catalog."""
    import types

    import torch

    from hetc.runtime import measure

    def never(*_args, **_kwargs):
        raise AssertionError("measured what one GPU cannot")

    samples = [measure.LayerSample(name, b, 128, 1e-3, 2e-3) for name in ("embed", "block", "head") for b in (1, 2)]
    monkeypatch.setattr(measure, "local_device", lambda: torch.device("cuda"))
    monkeypatch.setattr(measure, "time_layers", lambda *_args, **_kwargs: samples)
    monkeypatch.setattr(measure, "copy_rates", lambda *_args: [{"direction": "h2d", "bytes": 1 << 20, "seconds": 2e-5}])
    monkeypatch.setattr(measure, "comm_rates", never)
    monkeypatch.setattr(measure, "time_layers_at_once", never)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_args: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_args: types.SimpleNamespace(total_memory=141e9))
    out = tmp_path / "h200.json"
    assert main(["profile", "-o", str(out), "--ranks", "2", "--ranks-at-once", "8"]) == 0
    err = capsys.readouterr().err
    assert "hetc profile: not measured: collectives and point-to-point between 2 processes" in err
    assert "hetc profile: not measured: the layers in 8 processes at once" in err
    data = json.loads(out.read_text())
    assert data["device"]["kind"] == "H200"
    assert not {"collectives", "p2p", "concurrency", "core_wait"} & data.keys()     # absent, not 0
    assert len(data["not_measured"]) == 2
    profiles = load_profiles([out])
    assert profiles.compute and profiles.copy["H200"] > 0
    assert profiles.network.intra_rate("H200", 2) is None and profiles.shared == {}


def test_a_profile_without_network_rates_times_the_layers_and_takes_links_from_the_spec(tmp_path, capsys):
    layers = [{"layer": name, "tp": 1, "seq": 32, "micro_batch": b, "forward_s": f * b, "backward_s": 2 * f * b}
              for name, f in (("embed", 1e-4), ("block", 1e-3), ("head", 3e-4)) for b in (1, 2)]
    profile = tmp_path / "layers_only.json"
    profile.write_text(json.dumps({"format": FORMAT, "version": VERSION, "device": {"kind": "cpu"},
                                   "dtype": "fp32", "model": {"hidden": 64, "block_params": 46208},
                                   "layers": layers, "not_measured": ["collectives: no GPU each"]}))
    assert main(["explain", str(DEMO / "pp.het"), "--json", "--profile", str(profile)]) == 0
    explained = json.loads(capsys.readouterr().out)
    assert all(str(profile) in s for srcs in explained["sources"].values() for s in srcs)     # layers: measured
    assert explained["links"] and all(str(profile) not in link["source"] for link in explained["links"])


def test_a_gpu_kind_is_not_measured_on_a_cpu_nor_a_cpu_kind_on_a_gpu(tmp_path, monkeypatch, capsys):
    """--device-kind names the device measured: on a machine without a GPU, `--device-kind H100` would record
    the CPU's layers, memory copies and loopback gloo as an H100's compute, host link and NVLink."""
    import torch

    from hetc.runtime import measure

    out = tmp_path / "h100.json"
    monkeypatch.setattr(measure, "local_device", lambda: torch.device("cpu"))
    assert main(["profile", "--device-kind", "H100", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--device-kind H100: this machine has no GPU" in err and "records only what it measured" in err
    assert not out.exists()
    monkeypatch.setattr(measure, "local_device", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_args: "NVIDIA H200")
    assert main(["profile", "--device-kind", "cpu", "-o", str(out)]) == 2
    assert "--device-kind cpu: this machine measures its GPU (NVIDIA H200)" in capsys.readouterr().err
    assert not out.exists()
