"""doctor's ``nccl_warnings``: the NCCL_* settings that break or slow this launch, each rule a
row checked against the NCCL documentation its source names (planning/nccl_settings.py)."""

from __future__ import annotations

import json

import pytest
from sglang_sm120.machine.cache import host_fingerprint
from sglang_sm120.machine.facts import load_profile
from sglang_sm120.planning.nccl_settings import (
    NCCL_RULES,
    nccl_env_to_apply,
    nccl_warnings,
    tuned_nccl_env,
    warning_lines,
)
from sglang_sm120.planning.policy import AllReducePlan, Deployment, plan_allreduce
from sglang_sm120.planning.tuning import (
    PREFILL_TOKENS,
    Measurement,
    TuningTable,
    VariantMeasurement,
)
from sglang_sm120.planning.upstream import FUSION_ARCHS

KIMI = "KimiK25ForConditionalGeneration"
PCIE, NOP2P, NVLINK = "rtx-pro-6000-x8-pcie", "rtx-5090-x2-nop2p", "h200-x8-nvlink"


def warned(profile: str, tp: int, env: dict[str, str], **deployment) -> dict[str, str]:
    facts = load_profile(profile)
    d = Deployment(tp_size=tp, model_arch=KIMI, **deployment)
    plan = plan_allreduce(facts, d, FUSION_ARCHS)
    return {w.variable: w.problem for w in nccl_warnings(env, facts, d, plan)}


# profile, tp, env, deployment, the warning's variable (None: no warning), in its text
ROWS = [
    # P2P off in NCCL where every pair has it: NCCL stages through host memory (SHM)
    (PCIE, 8, {"NCCL_P2P_DISABLE": "1"}, {}, "NCCL_P2P_DISABLE", "host memory"),
    (NOP2P, 2, {"NCCL_P2P_DISABLE": "1"}, {}, None, ""),  # no P2P to lose
    (PCIE, 8, {"NCCL_P2P_DISABLE": "0"}, {}, None, ""),
    # P2P level: below SYS loses the cross-socket pairs (GPUs 0-3 on NUMA 0, 4-7 on NUMA 1)
    (PCIE, 8, {"NCCL_P2P_LEVEL": "PHB"}, {}, "NCCL_P2P_LEVEL", "NUMA nodes 0, 1"),
    (PCIE, 8, {"NCCL_P2P_LEVEL": "3"}, {}, "NCCL_P2P_LEVEL", "NUMA nodes 0, 1"),
    (PCIE, 4, {"NCCL_P2P_LEVEL": "PHB"}, {}, None, ""),  # GPUs 0-3: one NUMA node
    (PCIE, 8, {"NCCL_P2P_LEVEL": "SYS"}, {}, None, ""),
    (PCIE, 2, {"NCCL_P2P_LEVEL": "NVL"}, {}, "NCCL_P2P_LEVEL", "this host has none"),
    (NVLINK, 8, {"NCCL_P2P_LEVEL": "NVL"}, {}, None, ""),
    (PCIE, 2, {"NCCL_P2P_LEVEL": "loc"}, {}, "NCCL_P2P_LEVEL", "LOC: never"),
    # no LL for small messages, where decode/verify all-reduces reach NCCL
    (NOP2P, 2, {"NCCL_PROTO": "Simple"}, {}, "NCCL_PROTO", "LL128 or Simple"),
    (NOP2P, 2, {"NCCL_PROTO": "^LL"}, {}, "NCCL_PROTO", "low-latency"),
    (NOP2P, 2, {"NCCL_PROTO": "LL,Simple"}, {}, None, ""),
    (NOP2P, 2, {"NCCL_PROTO": "allreduce:Simple;allgather:LL"}, {}, "NCCL_PROTO", "LL"),
    (NOP2P, 2, {"NCCL_PROTO": "allgather:Simple"}, {}, None, ""),
    (PCIE, 8, {"NCCL_PROTO": "Simple"}, {}, None, ""),  # PCIe-IPC serves decode/verify
    (NVLINK, 8, {"NCCL_PROTO": "Simple"}, {}, None, ""),  # custom all-reduce serves them
    (NVLINK, 8, {"NCCL_PROTO": "Simple"}, {"custom_all_reduce": False}, "NCCL_PROTO", "LL"),
    # Tree only, under CUDA graphs: failed capture in the investigation behind this project
    (PCIE, 8, {"NCCL_ALGO": "Tree"}, {}, "NCCL_ALGO", "capture failed"),
    (PCIE, 8, {"NCCL_ALGO": "tree,ring"}, {}, None, ""),
    (PCIE, 8, {"NCCL_ALGO": "^Ring"}, {}, "NCCL_ALGO", "only Tree"),
    (PCIE, 8, {"NCCL_ALGO": "Ring"}, {}, None, ""),
    (PCIE, 1, {"NCCL_ALGO": "Tree", "NCCL_P2P_DISABLE": "1"}, {}, None, ""),  # no all-reduce
]


@pytest.mark.parametrize(("profile", "tp", "env", "deployment", "variable", "text"), ROWS)
def test_nccl_rule_row(profile, tp, env, deployment, variable, text):
    found = warned(profile, tp, env, **deployment)
    if variable is None:
        assert found == {}
    else:
        assert list(found) == [variable] and text in found[variable], found


def test_every_rule_names_its_fix_and_source():
    for rule in NCCL_RULES:
        assert rule.fix and rule.source, rule.variable
        assert "NCCL User Guide" in rule.source or "measured" in rule.source


def test_warnings_show_the_value_the_fix_and_the_source():
    facts = load_profile(PCIE)
    d = Deployment(tp_size=8, model_arch=KIMI)
    plan = plan_allreduce(facts, d, FUSION_ARCHS)
    env = {"NCCL_P2P_DISABLE": "1", "NCCL_ALGO": "Tree", "PATH": "/bin"}
    lines = warning_lines(nccl_warnings(env, facts, d, plan))
    assert lines[0] == "NCCL settings that break or slow this launch:"
    assert (
        lines[1].startswith("  NCCL_P2P_DISABLE='1': ")
        and "fix: unset NCCL_P2P_DISABLE" in lines[1]
    )
    assert "NCCL User Guide, Environment Variables: NCCL_P2P_DISABLE" in lines[1]
    assert lines[2].startswith("  NCCL_ALGO='Tree': ")


# ---------------------------------------------- the NCCL variant a plan applies (issue 25 2c)

LL, SIMPLE = (("NCCL_PROTO", "LL"),), (("NCCL_PROTO", "Simple"),)
TREE, RING, FEW = (("NCCL_ALGO", "Tree"),), (("NCCL_ALGO", "Ring"),), (("NCCL_MAX_NCHANNELS", "4"),)
SIZES = (8, 512)
DEFAULT_US = {8: 20.0, 512: 30.0}


PREFILL_US = 400.0  # NCCL's default at the prefill chunk (PREFILL_TOKENS)


def variant_rows(times: dict, prefill: dict | None = None) -> tuple[VariantMeasurement, ...]:
    """{env: us per SIZES (None: failed, with the note), or (us, correct)} -> table rows; each
    variant also at PREFILL_TOKENS, as fast as the default unless ``prefill`` {env: us} says."""
    rows = [VariantMeasurement((), t, DEFAULT_US[t], True) for t in SIZES]
    rows.append(VariantMeasurement((), PREFILL_TOKENS, PREFILL_US, True))
    for env, cells in times.items():
        for t, cell in zip(SIZES, cells, strict=True):
            us, correct = cell if isinstance(cell, tuple) else (cell, cell is not None)
            note = "" if us is not None else "failed: RuntimeError: CUDA graph capture invalidated"
            rows.append(VariantMeasurement(env, t, us, correct, note))
        us = (prefill or {}).get(env, PREFILL_US)
        rows.append(VariantMeasurement(env, PREFILL_TOKENS, us, True))
    return tuple(rows)


def tuned(
    times: dict,
    nccl_wins: bool = True,
    prefill: dict | None = None,
    table_version: int | None = None,
    **deployment,
):
    """(env, reason) on 8x SM120 at TP8 whose table leaves every size on NCCL (fusion off,
    plain NCCL), or none of them (``nccl_wins`` False: trtllm fastest everywhere); a table of
    ``table_version`` when given."""
    facts = load_profile(PCIE)
    fused = 5.0 if nccl_wins else 1.0
    rows = [Measurement("trtllm", t, fused * DEFAULT_US[t], True) for t in SIZES]
    rows += [Measurement("nccl", t, DEFAULT_US[t], True) for t in SIZES]
    table = TuningTable(
        host_fingerprint(facts, 8),
        8,
        7168,
        "bfloat16",
        tuple(rows),
        nccl_variants=variant_rows(times, prefill),
        **({} if table_version is None else {"version": table_version}),
    )
    d = Deployment(tp_size=8, model_arch=KIMI, pcie_ipc_env=False, tuning=table, **deployment)
    plan = plan_allreduce(facts, d, FUSION_ARCHS)
    return tuned_nccl_env(table, facts, d, plan)


def test_a_variant_clearly_faster_where_nccl_serves_is_chosen_with_its_numbers():
    env, reason = tuned({LL: (12.0, 20.0), RING: (19.0, 29.0)})
    assert env == LL
    assert reason.startswith("nccl env NCCL_PROTO=LL from the tuning table: 0.63x NCCL's default")
    assert "at [8, 512] tokens" in reason and "NCCL_ALGO=Ring 0.96x" in reason


def test_a_variant_within_noise_of_the_default_is_not_chosen():
    """Under UNFUSED_MIN_GAIN (3% and 0.5 us) NCCL's own per-size choice stays."""
    env, reason = tuned({RING: (19.6, 29.4), LL: (19.9, 29.9)})
    assert env == ()
    assert reason.startswith("nccl env: none (no NCCL variant beats NCCL's default by 3%")
    assert "NCCL_ALGO=Ring 0.98x" in reason


def test_a_variant_that_failed_capture_is_excluded_with_its_reason():
    env, reason = tuned({RING: (5.0, None), LL: (15.0, 25.0)})
    assert env == LL
    assert (
        "excluded: NCCL_ALGO=Ring (at 512 tokens: failed: RuntimeError: CUDA graph "
        "capture invalidated)" in reason
    )


def test_a_channel_count_variant_is_never_chosen_however_fast():
    """NCCL_MAX_NCHANNELS has no per-collective form: it would set every collective's channel
    count, and tune timed the all-reduce only (a version-3 table may still carry it)."""
    env, reason = tuned({FEW: (5.0, 10.0), LL: (15.0, 25.0)})
    assert env == LL
    assert "excluded: NCCL_MAX_NCHANNELS=4 (NCCL_MAX_NCHANNELS has no per-collective form" in reason


def test_a_variant_must_also_save_half_a_microsecond_per_call(monkeypatch):
    """UNFUSED_MIN_GAIN's absolute part: 0.95x at sizes NCCL serves in ~6 us saves 0.3 us per
    call, under the 0.5 us a variant must save; the same ratio at 20/30 us is chosen."""
    monkeypatch.setitem(DEFAULT_US, 8, 6.0)
    monkeypatch.setitem(DEFAULT_US, 512, 6.0)
    env, reason = tuned({LL: (5.7, 5.7)})
    assert env == () and "beats NCCL's default by 3% and 0.5 us" in reason
    assert "NCCL_PROTO=LL 0.95x" in reason
    monkeypatch.setitem(DEFAULT_US, 8, 20.0)
    monkeypatch.setitem(DEFAULT_US, 512, 30.0)
    assert tuned({LL: (19.0, 28.5)})[0] == LL


def test_a_variant_wrong_at_any_size_is_excluded():
    env, reason = tuned({LL: ((5.0, False), 10.0)})
    assert env == () and "NCCL_PROTO=LL (wrong at [8] tokens)" in reason


@pytest.mark.parametrize(
    ("variant", "rule"),
    [(TREE, "capture failed this way"), (SIMPLE, "may not use LL")],
)
def test_a_variant_doctor_would_warn_about_is_never_chosen(variant, rule):
    """NCCL_ALGO=Tree under CUDA graphs, and a protocol without LL where decode/verify reach
    NCCL: the warnings table (NCCL_RULES) says why, whatever tune timed."""
    env, reason = tuned({variant: (5.0, 10.0)})
    assert env == () and "doctor would warn" in reason and rule in reason


def test_no_variant_where_no_measured_size_stays_on_nccl():
    env, reason = tuned({LL: (5.0, 10.0)}, nccl_wins=False)
    assert (env, reason) == ((), "nccl env: none (no measured size stays on NCCL in this plan)")


def test_a_variant_slower_at_a_prefill_chunk_is_not_chosen():
    """One setting serves every NCCL call of the process: a variant faster at decode sizes but
    slower at the prefill chunk's all-reduce is excluded, with the numbers."""
    env, reason = tuned({LL: (12.0, 20.0), RING: (18.0, 27.0)}, prefill={LL: 520.0})
    assert env == RING
    assert f"NCCL_PROTO=LL (1.30x NCCL's default at {PREFILL_TOKENS} tokens (prefill)" in reason


def test_with_ray_no_variant_is_planned():
    """Ray's actors load no SGLang plugin: nothing would set it, so the plan names none."""
    env, reason = tuned({LL: (5.0, 10.0)}, ray=True)
    assert env == () and "--use-ray" in reason


def test_deterministic_inference_keeps_sglangs_own_nccl_settings():
    env, reason = tuned({LL: (5.0, 10.0)}, deterministic=True)
    assert env == () and "SGLang pins NCCL_ALGO" in reason


@pytest.mark.parametrize(
    ("deployment", "said"),
    [
        ({"attention_dp": True}, "--enable-dp-attention"),
        ({"moe_a2a_backend": "deepep"}, "--moe-a2a-backend deepep"),
    ],
)
def test_a_variant_tune_timed_on_the_tp_group_only_is_not_set_for_other_groups(deployment, said):
    """`allreduce:LL` reaches every all-reduce of the worker: with attention-DP or a MoE
    all-to-all backend those run on groups of another size that tune never timed."""
    env, reason = tuned({LL: (5.0, 10.0)}, **deployment)
    assert env == () and said in reason


def test_a_version_2_table_applies_none_of_its_nccl_variants():
    """A version-2 table predates tune's NCCL variants (docs/routing.md): whatever variants it
    carries, the plan sets none and says why."""
    env, reason = tuned({LL: (5.0, 10.0)}, table_version=2)
    assert env == () and reason == (
        "nccl env: none (a version-2 tuning table: its NCCL variants are not applied; re-run tune)"
    )


def test_a_table_without_variants_says_to_re_run_tune():
    facts = load_profile(PCIE)
    rows = tuple(Measurement("nccl", t, DEFAULT_US[t], True) for t in SIZES)
    table = TuningTable(host_fingerprint(facts, 8), 8, 7168, "bfloat16", rows, version=2)
    d = Deployment(tp_size=8, model_arch=KIMI, pcie_ipc_env=False, tuning=table)
    env, reason = tuned_nccl_env(table, facts, d, plan_allreduce(facts, d, FUSION_ARCHS))
    assert env == () and "re-run tune" in reason


SCOPED_LL = (("NCCL_PROTO", "allreduce:LL"),)
PLAN_WITH_LL = AllReducePlan(
    True, None, "nccl", ("r",), ((512, "nccl"),), nccl_env=LL, nccl_reason="nccl env LL ..."
)


@pytest.mark.parametrize(
    ("environ", "applied", "line"),
    [
        # for the all-reduce only, which tune timed: NCCL keeps its own choice elsewhere
        ({}, SCOPED_LL, "nccl env: NCCL_PROTO=allreduce:LL set before NCCL starts; nccl env LL"),
        ({"NCCL_PROTO": "Simple"}, (), "the user's NCCL_PROTO='Simple' wins"),
        ({"NCCL_MIN_NCHANNELS": "8"}, (), "the user's NCCL_MIN_NCHANNELS='8' wins"),
        ({"NCCL_P2P_LEVEL": "SYS"}, SCOPED_LL, "NCCL_PROTO=allreduce:LL set"),  # not weighed
        ({"NCCL_TUNER_PLUGIN": "libnccl-tuner.so"}, (), "the user's NCCL_TUNER_PLUGIN="),
        ({"NCCL_ENV_PLUGIN": "libnccl-env.so"}, (), "the user's NCCL_ENV_PLUGIN="),
        # NCCL's names for the channel bounds since 2.17, and the legacy ones
        ({"NCCL_MIN_CTAS": "16"}, (), "the user's NCCL_MIN_CTAS='16' wins"),
        ({"NCCL_MAX_CTAS": "4"}, (), "the user's NCCL_MAX_CTAS='4' wins"),
        ({"NCCL_MIN_NRINGS": "16"}, (), "the user's NCCL_MIN_NRINGS='16' wins"),
        ({"NCCL_MAX_NRINGS": "4"}, (), "the user's NCCL_MAX_NRINGS='4' wins"),
    ],
)
def test_the_users_own_nccl_tuning_wins_over_the_plans(environ, applied, line):
    env, said = nccl_env_to_apply(PLAN_WITH_LL, environ)
    assert env == applied and line in said


def test_the_published_plan_carries_its_nccl_env_and_refuses_another():
    data = PLAN_WITH_LL.to_json()
    assert data["nccl_env"] == {"NCCL_PROTO": "LL"}
    assert AllReducePlan.from_json(json.loads(json.dumps(data))) == PLAN_WITH_LL
    data["nccl_env"] = {"NCCL_PROTO": "LL; rm -rf /"}
    with pytest.raises(ValueError, match=r"plan\.nccl_env\.NCCL_PROTO"):
        AllReducePlan.from_json(data)


def test_a_protocol_chosen_in_nccls_config_file_wins_over_the_plans(tmp_path):
    """NCCL applies NCCL_CONF_FILE (or ~/.nccl.conf) and /etc/nccl.conf for what the environment
    leaves unset: a choice made there is the user's, as one exported."""
    from sglang_sm120.machine.nccl_conf import nccl_settings

    conf = tmp_path / "nccl.conf"
    conf.write_text("# site settings\nNCCL_DEBUG=WARN\nNCCL_PROTO=Simple\n")
    environ = {"NCCL_CONF_FILE": str(conf), "HOME": str(tmp_path)}
    settings = nccl_settings(environ)
    assert settings["NCCL_PROTO"] == "Simple" and settings["NCCL_DEBUG"] == "WARN"
    env, said = nccl_env_to_apply(PLAN_WITH_LL, settings)
    assert env == () and "the user's NCCL_PROTO='Simple' wins" in said
    exported = nccl_settings({**environ, "NCCL_PROTO": "LL"})  # the environment's own first
    assert exported["NCCL_PROTO"] == "LL"


# ------------------------------------------ what NCCL reads, the way NCCL reads it (issue 32 2)


def _two_homes(tmp_path, monkeypatch, env_line: str, passwd_line: str):
    import pwd
    from types import SimpleNamespace

    env_home, passwd_home = tmp_path / "home-env", tmp_path / "home-passwd"
    for home, line in ((env_home, env_line), (passwd_home, passwd_line)):
        home.mkdir()
        (home / ".nccl.conf").write_text(line + "\n" if line else "")
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: SimpleNamespace(pw_dir=str(passwd_home)))
    return env_home, passwd_home


def test_the_home_nccl_conf_of_home_is_read_as_the_pinned_nccl_reads_it(tmp_path, monkeypatch):
    """NCCL 2.30 (the pinned nvidia-nccl-cu13 2.30.7, whose library imports getenv and no
    getpwuid) takes ~/.nccl.conf from $HOME: a container's -e HOME=... file is NCCL's."""
    from sglang_sm120.machine.nccl_conf import nccl_settings

    env_home, _ = _two_homes(tmp_path, monkeypatch, "NCCL_PROTO=Simple", "")
    settings = nccl_settings({"HOME": str(env_home)})
    assert settings["NCCL_PROTO"] == "Simple"
    assert settings.source("NCCL_PROTO") == str(env_home / ".nccl.conf")


def test_the_passwd_homes_nccl_conf_is_read_too_for_older_nccl(tmp_path, monkeypatch):
    """NCCL up to 2.29 took the home from getpwuid(getuid()): a setting there is the user's as
    well, for whichever NCCL the worker loads, so it keeps the tuned variant off. $HOME's wins
    where both set a name (the pinned NCCL reads it)."""
    from sglang_sm120.machine.nccl_conf import nccl_settings

    env_home, passwd_home = _two_homes(
        tmp_path, monkeypatch, "NCCL_PROTO=Simple", "NCCL_PROTO=LL128\nNCCL_ALGO=Ring"
    )
    settings = nccl_settings({"HOME": str(env_home)})
    assert settings["NCCL_PROTO"] == "Simple"
    assert settings["NCCL_ALGO"] == "Ring"
    assert settings.source("NCCL_ALGO") == str(passwd_home / ".nccl.conf")


def test_config_lines_are_parsed_as_nccl_parses_them(tmp_path):
    """NCCL splits each line at its first '=' and trims nothing (but the line end): a name with
    a space around it is another variable, which NCCL never reads."""
    from sglang_sm120.machine.nccl_conf import nccl_settings

    conf = tmp_path / "nccl.conf"
    conf.write_bytes(
        b"NCCL_PROTO = Simple\n  NCCL_P2P_DISABLE=1\n#NCCL_ALGO=Tree\nNCCL_DEBUG=WARN\r\n"
        b"NCCL_P2P_LEVEL=PIX=2\n"
    )
    settings = nccl_settings({"NCCL_CONF_FILE": str(conf), "HOME": str(tmp_path / "none")})
    assert "NCCL_PROTO" not in settings and "NCCL_P2P_DISABLE" not in settings
    assert "NCCL_ALGO" not in settings
    assert settings["NCCL_DEBUG"] == "WARN"
    assert settings["NCCL_P2P_LEVEL"] == "PIX=2"


def _fifo(path):
    import os

    os.mkfifo(path)
    return path


def _not_utf8(path):
    path.write_bytes(b"NCCL_DEBUG=WARN\n\xff\xfe\n")
    return path


def _large(path):  # NCCL reads all of it: a setting past any small bound still counts
    path.write_text("# padding\n" * 200_000 + "NCCL_PROTO=Simple\n")
    return path


def _under_a_file(path):
    path.write_text("")
    return path / "nccl.conf"


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (_fifo, "a FIFO, not a regular file"),
        (lambda path: "/dev/zero", "a character device, not a regular file"),
        (_not_utf8, "not UTF-8 text"),
        (_large, "over 1 MiB"),
        (_under_a_file, "Not a directory"),
    ],
)
def test_a_config_file_that_cannot_be_read_may_set_anything_so_nothing_is_exported(
    tmp_path, make, why
):
    from sglang_sm120.machine.nccl_conf import nccl_settings

    path = make(tmp_path / "nccl.conf")
    settings = nccl_settings({"NCCL_CONF_FILE": str(path)})
    assert settings.unreadable.startswith(f"NCCL's config file {path} unreadable ("), settings
    assert why in settings.unreadable
    env, said = nccl_env_to_apply(PLAN_WITH_LL, settings)
    assert env == () and said == (
        f"nccl env: tuned NCCL_PROTO=allreduce:LL not set: {settings.unreadable}, which may set "
        "anything"
    )


def test_an_absent_config_file_sets_nothing_as_for_nccl(tmp_path):
    from sglang_sm120.machine.nccl_conf import nccl_settings

    settings = nccl_settings({"NCCL_CONF_FILE": str(tmp_path / "absent.conf")})
    assert settings.unreadable is None
    assert nccl_env_to_apply(PLAN_WITH_LL, settings)[0] == SCOPED_LL


def test_doctors_warnings_read_nccls_config_files_under_the_environment(tmp_path):
    """One reader for the warnings and the variant rule: NCCL_P2P_DISABLE=1 in NCCL_CONF_FILE
    is warned about, naming the file; the environment's value wins over the file's."""
    from sglang_sm120.machine.nccl_conf import nccl_settings

    conf = tmp_path / "nccl.conf"
    conf.write_text("NCCL_P2P_DISABLE=1\nNCCL_PROTO=Simple\n")
    facts = load_profile(PCIE)
    d = Deployment(tp_size=8, model_arch=KIMI, pcie_ipc_env=False)
    plan = plan_allreduce(facts, d, FUSION_ARCHS)
    found = nccl_warnings(nccl_settings({"NCCL_CONF_FILE": str(conf)}), facts, d, plan)
    assert [w.variable for w in found] == ["NCCL_P2P_DISABLE", "NCCL_PROTO"]
    assert found[0].set_in == str(conf)
    assert found[0].line().startswith(f"NCCL_P2P_DISABLE='1' (set in {conf}): NCCL's P2P")
    environ = {"NCCL_CONF_FILE": str(conf), "NCCL_P2P_DISABLE": "0", "NCCL_PROTO": "LL"}
    assert nccl_warnings(nccl_settings(environ), facts, d, plan) == ()


def test_doctor_says_which_config_file_it_could_not_check(tmp_path):
    from sglang_sm120.machine.nccl_conf import nccl_settings

    settings = nccl_settings({"NCCL_CONF_FILE": "/dev/zero"})
    lines = warning_lines((), settings.unreadable)
    assert lines[-1] == (
        "  NCCL's config file /dev/zero unreadable (a character device, not a regular file): "
        "its settings are not checked"
    )


def test_a_config_file_past_64_kib_is_read_whole_as_nccl_reads_it(tmp_path):
    from sglang_sm120.machine.nccl_conf import nccl_settings

    conf = tmp_path / "nccl.conf"
    conf.write_text("# site notes\n" * 8000 + "NCCL_PROTO=Simple\n")  # ~100 KiB
    settings = nccl_settings({"NCCL_CONF_FILE": str(conf)})
    env, said = nccl_env_to_apply(PLAN_WITH_LL, settings)
    assert env == () and "the user's NCCL_PROTO='Simple' wins" in said
