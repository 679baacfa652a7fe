"""`hetc import sailor|zorse`: the output passes `hetc check` and carries the same plan."""

from __future__ import annotations

import json

import pytest

from hetc.cli import main
from hetc.compiler import load_checked
from hetc.ir.spec import AUTO, RoutingKind, ScheduleKind

GPU_KINDS = {"GH-96": "GH200", "RTX-3090": "RTX3090", "RTX-2080": "RTX2080Ti", "Titan-RTX": "TitanRTX"}


@pytest.fixture
def sailor(shared_data):
    return shared_data / "sailor"


@pytest.fixture
def zorse(shared_data):
    return shared_data / "zorse"


def _import(args: list[str], out) -> int:
    return main(["import", *args, "-o", str(out)])


def _samples(sailor):
    return sorted((sailor / "validation-samples").rglob("*.json"))


def test_sailor_plans_round_trip(sailor, tmp_path):
    for sample in _samples(sailor):   # without --model: the plan's layer count names it
        out = tmp_path / f"{sample.stem}.het"
        assert _import(["sailor", "--data", str(sailor), "--plan", str(sample)], out) == 0
        named = "GPT-Neo-2.7" if "GPT-NEO" in str(sample) else "OPT-350"
        assert f"(model {named}," in out.read_text()
        assert main(["check", "-q", str(out)]) == 0
        _, checked = load_checked(out)
        _same_plan(json.loads(sample.read_text()), checked)


def _same_plan(raw: dict, checked) -> None:
    plan, p = raw["pipeline_list"][0], checked.pipeline
    assert p.schedule is ScheduleKind.ONE_F_ONE_B and p.micro_batch == raw["mbs"]
    assert p.num_microbatches * p.micro_batch == raw["gbs"]
    first = 0
    stages = zip(p.stages, plan["layers_per_stage"], plan["tmp_per_stage"], strict=True)
    for stage, layers, replicas in stages:
        span = range(first, first + len(layers))
        assert [i for ms in stage.ministages for i in p.ministages[ms].layers] == list(span)
        first = span.stop
        assert len(stage.lanes) == len(replicas)
        for lane, (vms, tp) in zip(stage.lanes, replicas, strict=True):
            assert stage.tp == tp and len(lane.ranks) == tp
            gpus = [p.world[r] for r in lane.ranks]
            assert {g.device.name for g in gpus} == {GPU_KINDS[vms[0][0]]}
            assert {g.host for g in gpus} == {gpus[0].host}, "TP stays inside one node"
            assert {g.zone for g in gpus} == {vms[0][2]}
    # replica j of every stage serves the same microbatches: Sailor's pipeline j
    for j in range(len(p.stages[0].lanes)):
        assert len({s.lanes[j].microbatches for s in p.stages}) == 1


def test_sailor_quotas_give_an_auto_plan(sailor, tmp_path):
    quotas = tmp_path / "quotas.json"
    quotas.write_text(json.dumps({"A100-40": {"us-central1-a": 8}, "V100-16": {"us-central1-b": 4}}))
    out = tmp_path / "auto.het"
    assert _import(["sailor", "--data", str(sailor), "--model", "OPT-350", "--quotas", str(quotas)], out) == 0
    _, checked = load_checked(out)
    assert checked.pipeline is None and checked.spec.parallel.stages is AUTO
    kinds = sorted((g.device.name, g.zone) for g in checked.topology.gpus)
    assert kinds.count(("A100-40", "us-central1-a")) == 8 and kinds.count(("V100-16", "us-central1-b")) == 4
    assert main(["explain", str(out)]) == 2   # nothing to explain before `hetc plan`


def test_zorse_plan_round_trip(zorse, tmp_path):
    config = json.loads((zorse / "example/training_config.json").read_text())
    out = tmp_path / "zorse.het"
    args = ["zorse", "--data", str(zorse), "--cluster", str(zorse / "example/cluster_info.json"),
            "--model", config["model_name"], "--plan", str(zorse / "example/training_config.json")]
    assert _import(args, out) == 0
    assert main(["check", "-q", str(out)]) == 0
    _, checked = load_checked(out)
    p, cfg = checked.pipeline, config["pipeline_config"]
    assert p.schedule is ScheduleKind.ZORSE and p.micro_batch == config["microbatch_size"]
    assert len(p.stages) == len(cfg)
    info = json.loads((zorse / "example/cluster_info.json").read_text())
    names = {g["global_rank"]: g["name"] for g in info["gpu_list"]}
    for stage, st in zip(p.stages, cfg, strict=True):
        assert len(stage.ministages) == config["interleave_degree"]
        counts = [len(lane.microbatches) for lane in stage.lanes]
        assert counts == st["num_microbatches_per_rank"]                  # uneven, as Zorse routes them
        kinds = [p.world[lane.ranks[0]].device.name.lower() for lane in stage.lanes]
        assert kinds == [names[r].lower() for r in st["gpu_ranks"]]
    spec = checked.spec.parallel.stages[0]
    assert spec.microbatches.kind is RoutingKind.COUNTS


@pytest.mark.parametrize("content, message", [
    ("{", "not valid JSON"),
    ('{"pipeline_list": []}', "not a Sailor plan"),
    (('{"pipeline_list": [{"layers_per_stage": [[0, 1]], "tmp_per_stage": [[[[["GH-96", 4, "z-a"]], 4]]],'
      ' "dp": [1]}], "mbs": 1, "gbs": 1}'), "covers 2 layers"),
])
def test_bad_sailor_plans_are_usage_errors(sailor, tmp_path, capsys, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    rc = main(["import", "sailor", "--data", str(sailor), "--model", "OPT-350", "--plan", str(bad)])
    assert rc == 2 and message in capsys.readouterr().err


def test_a_plan_no_model_fits_asks_for_the_model(sailor, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text('{"pipeline_list": [{"layers_per_stage": [[0, 1]], "tmp_per_stage": [], "dp": [1]}], '
                    '"mbs": 1, "gbs": 1}')
    assert main(["import", "sailor", "--data", str(sailor), "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "covers 2 layers: no model" in err and "GPT-Neo-2.7 (34), OPT-350 (26)" in err
    assert "name it with --model" in err
    assert main(["import", "sailor", "--data", str(sailor), "--quotas", str(plan)]) == 2
    assert "--quotas needs --model NAME" in capsys.readouterr().err


def test_bad_inputs_name_the_file(sailor, tmp_path, capsys):
    assert main(["import", "sailor", "--data", str(tmp_path / "nowhere"), "--model", "OPT-350",
                 "--plan", "x.json"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["import", "sailor", "--data", str(sailor), "--model", "GPT-9", "--plan", "x.json"]) == 2
    assert "known: GPT-Neo-2.7, OPT-350" in capsys.readouterr().err
    assert main(["import", "sailor", "--data", str(sailor), "--model", "OPT-350",
                 "--plan", str(tmp_path / "missing.json")]) == 2
    assert "cannot find the Sailor plan" in capsys.readouterr().err
    assert main(["import", "zorse", "--data", str(sailor), "--cluster", "c.json", "--model", "m"]) == 2
    assert "cannot find the Zorse model stats" in capsys.readouterr().err


def _edited(src, dest, edit):
    """A copy of the JSON file `src` at `dest`, `edit` applied to its parsed value."""
    obj = json.loads(src.read_text())
    edit(obj)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(obj))
    return dest


@pytest.mark.parametrize(("edit", "message"), [
    (lambda o: o["machines"][0].update(gpus=[{"name": "l4", "global_rank": "x"}]),
     "is not laid out as expected: invalid literal for int() with base 10: 'x'"),
    (lambda o: o.update(bandwidth=[]), "is not laid out as expected: 'list' object has no attribute 'get'"),
    (lambda o: o["machines"][0]["gpus"][0].pop("name"), "is not laid out as expected: no 'name'"),
])
def test_a_zorse_cluster_of_another_shape_names_the_file(zorse, tmp_path, capsys, edit, message):
    """Zorse's files read by their layout: a value of another type or a missing key is a usage error that
    names the file, exit 2, not an internal error."""
    cluster = _edited(zorse / "example/cluster_info.json", tmp_path / "cluster_info.json", edit)
    config = json.loads((zorse / "example/training_config.json").read_text())
    assert main(["import", "zorse", "--data", str(zorse), "--cluster", str(cluster),
                 "--model", config["model_name"], "--plan", str(zorse / "example/training_config.json")]) == 2
    err = capsys.readouterr().err
    assert f"the Zorse cluster description '{cluster}' {message}" in err


def test_a_zorse_plan_of_another_shape_names_the_file(zorse, tmp_path, capsys):
    plan = _edited(zorse / "example/training_config.json", tmp_path / "training_config.json",
                   lambda o: o["pipeline_config"][0].update(layer_partition=7))
    assert main(["import", "zorse", "--data", str(zorse), "--cluster", str(zorse / "example/cluster_info.json"),
                 "--model", json.loads(plan.read_text())["model_name"], "--plan", str(plan)]) == 2
    assert f"'{plan.name}': stage 0 lacks" in capsys.readouterr().err


def test_a_sailor_network_table_of_another_shape_names_the_file(sailor, tmp_path, capsys):
    """Sailor's network tables nest objects by GPU kind and count: a number where an object is names the file
    (`hetc import` and `hetc explain --profile` read them alike)."""
    import shutil

    data = tmp_path / "sailor"
    shutil.copytree(sailor, data, ignore=shutil.ignore_patterns("validation-samples"))
    _edited(sailor / "intra_node_bandwidths.json", data / "intra_node_bandwidths.json",
            lambda o: o.update({next(iter(o)): 5}))
    plan = next((sailor / "validation-samples").rglob("*.json"))
    assert main(["import", "sailor", "--data", str(data), "--plan", str(plan), "-o", str(tmp_path / "x.het")]) == 2
    err = capsys.readouterr().err
    assert f"{data / 'intra_node_bandwidths.json'}: not laid out as Sailor's network tables are" in err


_ZORSE_LATENCIES = {"llama": {"A100-40": {"2048": {"float16": [[1.5, 2.0], [3.0, 4.0]]}}}}
_ZORSE_STATS = {"llama": {"hidden_size": 4096, "num_layers": 32, "parameters_per_layer": 202383360}}


@pytest.mark.parametrize("latencies, stats, says", [
    (_ZORSE_LATENCIES, {"llama": {"hidden_size": 4096, "num_layers": 32}}, "no 'parameters_per_layer'"),
    (_ZORSE_LATENCIES, {"llama": 5}, "not subscriptable"),
    (_ZORSE_LATENCIES, ["llama"], "has no attribute 'get'"),
    ({"llama": {"A100-40": 3}}, _ZORSE_STATS, "has no attribute 'items'"),
    ({"llama": {"A100-40": {"long": {"float16": [[1.5, 2.0], [3.0, 4.0]]}}}}, _ZORSE_STATS, "'long'"),
    (_ZORSE_LATENCIES, {"llama": {**_ZORSE_STATS["llama"], "hidden_size": [4096]}}, "int() argument"),
])
def test_a_zorse_data_folder_of_another_shape_names_the_folder(tmp_path, latencies, stats, says):
    """`explain --profile ZORSE_DIR` walked Zorse's tables unchecked: a number where an object is was a
    TypeError or AttributeError (fuzzing, 2026-12-06)."""
    from hetc.passes.cost import ProfileError
    from hetc.passes.cost.sources.zorse_data import LATENCIES, STATS, read_zorse

    (tmp_path / "data").mkdir()
    for name, table in ((LATENCIES, _ZORSE_LATENCIES), (STATS, _ZORSE_STATS)):
        (tmp_path / name).write_text(json.dumps(table))
    assert len(read_zorse(tmp_path).compute) == 1          # the folder as Zorse writes it reads
    (tmp_path / LATENCIES).write_text(json.dumps(latencies))
    (tmp_path / STATS).write_text(json.dumps(stats))
    with pytest.raises(ProfileError, match="not laid out as Zorse's data folder is") as err:
        read_zorse(tmp_path)
    assert says in str(err.value) and str(tmp_path) in str(err.value)
