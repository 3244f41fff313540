"""The profile file format: round trip, and a precise error for every kind of bad input."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tangram_sgl.profile import ModelIdentity, ProfileError, load_profile, profile_from_dict
from tangram_sgl.profile_builder import build_profile

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "hidden_size": 256,
    "intermediate_size": 512,
    "vocab_size": 1000,
}


def _doc(**kw) -> dict:
    model = ModelIdentity.from_config(CONFIG)
    mean = [[0.1, 0.2, 0.5, 0.9], [0.05, 0.3, 0.3, 0.6]]
    std = [[0.01, 0.02, 0.05, 0.05], [0.0, 0.1, 0.02, 0.1]]
    return build_profile(model, mean, std, scorer="snapkv", target_ratio=0.25, heads_per_group=2,
                         grouping=kw.pop("grouping", "per_layer"), **kw).to_dict()


def _write(tmp_path: Path, doc) -> Path:
    p = tmp_path / "p.json"
    p.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return p


def test_round_trip_and_model_check(tmp_path):
    doc = _doc()
    prof = load_profile(_write(tmp_path, doc), CONFIG)
    assert prof.to_dict() == doc
    # budget = min(1, mean + 2 std), groups sorted by budget within a layer
    assert prof.budget[0] == (0.12, 0.24, 0.6, 1.0)
    assert [g.members for g in prof.groups] == [((0, 3), (0, 2)), ((0, 1), (0, 0)), ((1, 3), (1, 1)),
                                                ((1, 2), (1, 0))]
    assert [g.budget for g in prof.groups] == [1.0, 0.24, 0.8, 0.34]


def _mutated(fn):
    doc = _doc()
    fn(doc)
    return doc


BAD = [
    ("unknown version", lambda d: d.update(version=7), r"version: unknown profile version 7"),
    ("not a profile", lambda d: d.update(format="x"), r"format: expected 'tangram-profile', found 'x'"),
    ("budget above 1", lambda d: d["heads"]["budget"][1].__setitem__(2, 1.5),
     r"heads.budget\[1\]\[2\]: budget must lie in \(0, 1\], found 1.5"),
    ("budget zero", lambda d: d["heads"]["budget"][0].__setitem__(0, 0.0),
     r"heads.budget\[0\]\[0\]: budget must lie in \(0, 1\], found 0.0"),
    ("wrong head count", lambda d: d["heads"]["mean"][0].pop(),
     r"heads.mean\[0\]: expected 4 kv heads \(model.num_kv_heads\), found 3"),
    ("wrong layer count", lambda d: d["heads"]["std"].pop(),
     r"heads.std: expected 2 layers \(model.num_layers\), found 1"),
    ("missing group", lambda d: d["groups"].pop(), r"groups: 2 heads belong to no group, first \[1, 0\]"),
    ("head in two groups", lambda d: d["groups"][1]["members"].__setitem__(0, [0, 3]),
     r"groups: head \[0, 3\] is in two groups \(0 and 1\)"),
    ("group too large", lambda d: d["groups"][0]["members"].append([1, 0]),
     r"groups\[0\].members: expected 1..2 heads \(heads_per_group\), found 3"),
    ("group budget not max", lambda d: d["groups"][0].update(budget=0.5),
     r"groups\[0\].budget: expected the max member budget 1.0, found 0.5"),
    ("head outside model", lambda d: d["groups"][0]["members"].__setitem__(0, [5, 0]),
     r"head \[5, 0\] outside the model's 2 layers x 4 kv heads"),
    ("missing field", lambda d: d.pop("aot_split"), r"aot_split: missing"),
    ("split table width", lambda d: d["aot_split"]["splits"][0].pop(),
     r"aot_split.splits\[0\]: expected 4 entries \(one per group\), found 3"),
    ("split out of range", lambda d: d["aot_split"]["splits"][0].__setitem__(0, 0),
     r"aot_split.splits\[0\]\[0\]: expected an integer in \[1, 32\], found 0"),
    ("wrong type", lambda d: d["model"].update(num_layers="2"), r"model.num_layers: expected int, found str"),
    ("per-layer group spans layers", lambda d: d["groups"][0]["members"].__setitem__(1, [1, 0]),
     r"per_layer grouping but members span layers"),
]


@pytest.mark.parametrize("name,mutate,message", BAD, ids=[b[0] for b in BAD])
def test_bad_profile_is_rejected_with_a_precise_message(tmp_path, name, mutate, message):
    with pytest.raises(ProfileError, match=message):
        load_profile(_write(tmp_path, _mutated(mutate)))


def test_truncated_and_malformed_files(tmp_path):
    text = json.dumps(_doc())
    with pytest.raises(ProfileError, match=r"not valid JSON \(truncated or malformed\) at line 1"):
        load_profile(_write(tmp_path, text[: len(text) // 2]))
    with pytest.raises(ProfileError, match=r"profile: expected a JSON object, found list"):
        profile_from_dict([1, 2])
    with pytest.raises(ProfileError, match=r"cannot read"):
        load_profile(tmp_path / "absent.json")


@pytest.mark.parametrize("field,value,message", [
    ("num_hidden_layers", 3, r"model.num_layers: the served model has 3, the profile was made for 2"),
    ("num_key_value_heads", 8, r"model.num_kv_heads: the served model has 8, the profile was made for 4"),
    ("model_type", "qwen2", r"model.model_type: the served model is 'qwen2', the profile says 'llama'"),
    ("vocab_size", 1001, r"model.config_hash: the served model hashes to sha256:\w+, the profile expects"),
])
def test_profile_for_another_model(tmp_path, field, value, message):
    other = copy.deepcopy(CONFIG)
    other[field] = value
    with pytest.raises(ProfileError, match=message):
        load_profile(_write(tmp_path, _doc()), other)


def test_cross_layer_grouping_partitions_all_heads():
    prof = profile_from_dict(_doc(grouping="cross_layer"))
    members = sorted(m for g in prof.groups for m in g.members)
    assert members == [(li, hi) for li in range(2) for hi in range(4)]
    # sorted by budget across layers: the two highest-budget heads share the first group
    assert set(prof.groups[0].members) == {(0, 3), (1, 3)}
