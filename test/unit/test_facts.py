"""Facts: embedded profiles, topology files, and a probe that never raises."""

from __future__ import annotations

import json

import pytest
from sglang_sm120.machine.facts import (
    facts_from_json,
    load_profile,
    load_topology,
    probe_host,
    profile_names,
)


def test_embedded_profiles():
    assert {"rtx-pro-6000-x8-pcie", "rtx-5090-x2-nop2p"} <= set(profile_names())
    pcie = load_profile("rtx-pro-6000-x8-pcie")
    assert [g.sm for g in pcie.gpus] == [120] * 8 and not pcie.has_nvlink
    assert pcie.all_pairs_p2p(range(8)) and pcie.numa_nodes(range(8)) == [0, 1]
    assert pcie.numa_nodes(range(4)) == [0]
    nop2p = load_profile("rtx-5090-x2-nop2p")
    assert nop2p.missing_p2p_pairs(range(2)) == [(0, 1)]


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"embedded profiles: .*rtx-pro-6000-x8-pcie"):
        load_profile("dgx-spark")


def test_one_way_p2p_counts_as_missing():
    facts = facts_from_json(
        {"gpus": [{"name": "g", "capability": [12, 0]}] * 2, "p2p": [[True, True], [False, True]]},
        "t",
    )
    assert facts.missing_p2p_pairs([0, 1]) == [(0, 1)]


def test_matrix_of_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="2x2 matrix"):
        facts_from_json({"gpus": [{"name": "g", "capability": [12, 0]}] * 2, "p2p": [[True]]}, "t")


def test_unreadable_topology_file(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read topology file"):
        load_topology(path)


def test_probe_never_raises_and_round_trips_to_json():
    facts = probe_host()
    json.dumps(facts.to_json())
    assert facts.gpus or facts.probe_error


def test_every_embedded_profile_follows_the_schema_and_describes_itself():
    from sglang_sm120.machine.facts import profile_descriptions

    for name, description in profile_descriptions().items():
        assert load_profile(name).gpus and description, name


def test_docs_topology_page_documents_every_topology_key():
    from pathlib import Path

    from sglang_sm120.machine.topology import GPU_KEYS, TOPOLOGY_KEYS

    page = (Path(__file__).resolve().parents[2] / "docs" / "topology.md").read_text()
    section = page.split("## Keys", 1)[1].split("\n## ", 1)[0]
    for key in [*TOPOLOGY_KEYS, *GPU_KEYS]:
        assert f"| `{key}` |" in section, key
