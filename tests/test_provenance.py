"""Every number says where it came from (Note [provenance] in passes/cost/provenance.py)."""

from __future__ import annotations

import json

import pytest

from hetc.cli import main
from hetc.passes.cost import ProfileError
from hetc.passes.cost.sources import load_profiles
from hetc.passes.cost.sources.hetc_profile import FORMAT, VERSION, profile_from_dict
from hetc.passes.cost.shapes import LayerKind
from hetc.passes.cost.params import block_params
from tests.costspecs import ONE_LANE, cluster, cost_model, plan_text, write_spec

# the parameters of one block of costspecs.MODEL (hidden 256, ffn 704, 4 heads of which 2 kv)
BLOCK = 4 * 256 * 256 - 2 * 256 * 128 + 3 * 256 * 704 + 2 * 256


def _profile(dtype: str, device: str = "A100-40", hidden: int = 256, block: int = BLOCK,
             collectives: bool = False) -> dict:
    """A `hetc profile` file's content for the test model (costspecs.MODEL) measured in `dtype`."""
    rows = [{"layer": "block", "tp": 1, "seq": 128, "micro_batch": b, "forward_s": 1e-3 * b,
             "backward_s": 2e-3 * b} for b in (1, 2)]
    out = {"format": FORMAT, "version": VERSION, "device": {"kind": device}, "dtype": dtype,
           "model": {"hidden": hidden, "block_params": block}, "layers": rows}
    if collectives:
        out["collectives"] = [{"kind": "all_reduce", "ranks": 2, "bytes": 1e6, "seconds": 1e-4}]
    return out


def _write(tmp_path, name: str, data: dict):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_the_test_profiles_have_the_test_models_shape(tmp_path):
    assert block_params(cost_model(tmp_path, plan_text(ONE_LANE)).model) == BLOCK


def test_a_bf16_profile_times_a_bf16_model(tmp_path):
    profiles = profile_from_dict(_profile("bf16"), "bf16.json")
    cm = cost_model(tmp_path, plan_text(ONE_LANE, dtype="bf16"), profiles)
    block = cm.compute.layer("A100-40", LayerKind.BLOCK, 1, 1)
    assert block.source == "bf16.json"
    assert block.forward == pytest.approx(1e-3) and block.backward == pytest.approx(2e-3)
    e = cm.estimate()
    assert all("bf16.json" in s for srcs in e.provenance.layers.values() for s in srcs if "arith" not in s)
    assert not e.provenance.unused
    # fp16 is the same speed class; fp32 is not
    assert cost_model(tmp_path, plan_text(ONE_LANE, dtype="fp16"), profiles).compute.layer(
        "A100-40", LayerKind.BLOCK, 1, 1).source == "bf16.json"
    fp32 = cost_model(tmp_path, plan_text(ONE_LANE), profiles)
    assert fp32.compute.layer("A100-40", LayerKind.BLOCK, 1, 1).source == "arithmetic"


def test_unused_profiles_are_listed_with_their_reason(tmp_path, capsys):
    spec = write_spec(tmp_path, plan_text(ONE_LANE))                 # an fp32 model on A100-40s
    bf16 = _write(tmp_path, "bf16.json", _profile("bf16"))
    v100 = _write(tmp_path, "v100.json", _profile("fp32", device="V100-16"))
    other = _write(tmp_path, "other.json", _profile("fp32", hidden=512, block=3_000_000))
    args = ["explain", str(spec), "--json", "--profile", str(bf16), "--profile", str(v100), "--profile", str(other)]
    assert main(args) == 0
    unused = {u["profile"]: u["reason"] for u in json.loads(capsys.readouterr().out)["unused_profiles"]}
    assert set(unused) == {str(bf16), str(v100), str(other)}
    assert "measured in bf16" in unused[str(bf16)] and "trains in fp32" in unused[str(bf16)]
    assert "V100-16, which holds no rank" in unused[str(v100)]
    assert "another model shape (hidden 512" in unused[str(other)]
    assert main(["explain", str(spec), "--profile", str(bf16)]) == 0
    text = capsys.readouterr().out
    assert "profiles offered but not used" in text and "measured in bf16" in text


def test_a_measured_link_lists_the_declaration_it_overrides(tmp_path, capsys):
    spec = write_spec(tmp_path, plan_text(ONE_LANE))
    prof = _write(tmp_path, "net.json", _profile("fp32", collectives=True))
    assert main(["explain", str(spec), "--json", "--profile", str(prof)]) == 0
    links = json.loads(capsys.readouterr().out)["links"]
    zero = [x for x in links if "ZeRO" in x["used_by"]]
    assert len(zero) == 1 and zero[0]["source"] == f"measured fit in {prof}"
    assert zero[0]["overrides"].startswith("the intra link of node group n at ")   # declared in cluster()
    assert main(["explain", str(spec), "--json"]) == 0
    (declared,) = [x for x in json.loads(capsys.readouterr().out)["links"] if "ZeRO" in x["used_by"]]
    assert declared["source"].startswith("the intra link of node group n at ") and declared["overrides"] is None


def test_plan_lists_the_sources_too(tmp_path, capsys):
    spec = write_spec(tmp_path, plan_text(ONE_LANE))
    bf16 = _write(tmp_path, "bf16.json", _profile("bf16"))
    assert main(["plan", str(spec), "--json", "--profile", str(bf16)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sources"] and out["links"]
    assert [u["profile"] for u in out["unused_profiles"]] == [str(bf16)]
    assert main(["plan", str(spec), "--profile", str(bf16)]) == 0
    err = capsys.readouterr().err
    assert "layer times from" in err and "link rates from" in err and "measured in bf16" in err


def test_a_profile_in_an_unknown_dtype_is_an_error(tmp_path):
    with pytest.raises(ProfileError, match="malformed"):
        load_profiles([_write(tmp_path, "bad.json", _profile("bf17"))])


def test_offload_copies_name_their_rate(tmp_path):
    body = ONE_LANE.replace("    lanes = 2\n", "    lanes = 2\n    offload { optimizer = cpu }\n")
    measured = dict(_profile("fp32"), copy=[{"direction": "h2d", "bytes": 1e6, "seconds": 1e-4}])
    cm = cost_model(tmp_path, plan_text(body), profile_from_dict(measured, "copy.json"))
    (host,) = [x for x in cm.estimate().provenance.links if "offload" in x.used_by]
    assert host.source == "measured in copy.json"
    (declared,) = [x for x in cost_model(tmp_path, plan_text(body)).estimate().provenance.links
                   if "offload" in x.used_by]
    assert declared.source.startswith("the host_link of device A100-40 at ")


def test_a_border_of_many_lanes_is_read_once_per_node_pair(tmp_path):
    """Provenance pairs a border's lanes by node (every lane by every lane was 18 million pairs at 16,384
    GPUs): 16 lanes a stage on 4 nodes each read 16 pairs, not 256, and list the one kind the border crosses."""
    from hetc.passes.cost.provenance import _crossings

    body = """
  stage a {
    layers = embed..block3
    ranks = n[0:4]
    lanes = 16
  }
  stage b {
    layers = block4..head
    ranks = n[4:8]
    lanes = 16
  }
"""
    cm = cost_model(tmp_path, plan_text(body, global_batch=32, clusters=cluster(nodes=8)))
    border = [(a.host, b.host) for used_by, a, b, _ in _crossings(cm) if used_by.startswith("pipeline")]
    assert len(border) == len(set(border)) == 16
    links = [x for x in cm.estimate().provenance.links if x.used_by.startswith("pipeline")]
    assert [x.between for x in links] == ["n <-> n"]
