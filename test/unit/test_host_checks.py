"""Host checks read from fixture hosts: one tree per problem under test/fixtures/hosts/ (sysfs,
procfs and the fake NVML's answers; ``build.py`` there says how each was made)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys

import pytest
from fake_nvml import FIXTURES, FakeNvml
from sglang_sm120.machine.host_checks import (
    CHECK_NAMES,
    SYSFS_ROOT_ENV,
    P2PSummary,
    acs_control,
    format_checks,
    ipc_workspace_bytes,
    registry_dwords,
    run_host_checks,
    sysfs_root,
)


@pytest.fixture(autouse=True)
def _all_gpus_visible(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def checks_of(case: str, tp: int = 8, **kwargs) -> dict:
    nvml = kwargs.pop("nvml", None) or FakeNvml.of(case)
    root = kwargs.pop("root", FIXTURES / case)
    checks = run_host_checks(tp, 7168, root=root, nvml=nvml, **kwargs)
    assert [c.name for c in checks] == list(CHECK_NAMES)
    return {c.name: c for c in checks}


def statuses(case: str, **kwargs) -> dict[str, str]:
    return {name: c.status for name, c in checks_of(case, **kwargs).items()}


# Each fixture host is the healthy one with one thing wrong: that check, and only it, reports.
ROWS = [
    # case, check, status, words the detail must contain, words the fix must contain
    ("healthy", None, None, (), ()),
    (
        "direct-staged",
        "p2p_driver",
        "fail",
        ("root ports", "no ForceP2P", "system memory"),
        ("NVreg_RegistryDwords", "ForceP2P=0x11"),
    ),
    (
        "acs-on",
        "acs",
        "fail",
        ("0000:02:00.0", "0000:02:01.0", "ReqRedir", "CmpltRedir"),
        ("pci=disable_acs_redir=", "BIOS"),
    ),
    ("acs-root-ports", "acs", "warn", ("root ports", "0000:00:01.1", "ReqRedir"), ("BIOS",)),
    ("iommu-on", "iommu", "warn", ("DMA-FQ", "0000:03:00.0"), ("iommu=pt",)),
    ("nonroot-config", "acs", "unknown", ("root only", "sudo sglang-sm120 doctor"), ()),
    (
        "downtrained",
        "pcie_link",
        "fail",
        ("GPU0 runs x8 of x16", "GPU1 trains at most Gen4 (the GPU does Gen5)"),
        ("riser",),
    ),
    ("small-bar1", "bar1", "fail", ("GPU0 256 MiB", "need 1016 MiB"), ("Resizable BAR",)),
    ("dual-socket", "topology", "warn", ("4 of 6 pairs cross sockets", "0-2"), ("one socket",)),
    ("persistence-off", "persistence", "warn", ("GPUs 0,1",), ("nvidia-smi -pm 1",)),
]


@pytest.mark.parametrize(
    ("case", "name", "status", "detail", "fix"), ROWS, ids=[r[0] for r in ROWS]
)
def test_fixture_host_reports_its_one_problem_with_the_fix(case, name, status, detail, fix):
    checks = checks_of(case)
    others = {n: c.status for n, c in checks.items() if n != name}
    assert set(others.values()) == {"ok"}, others
    if name is None:
        return
    check = checks[name]
    assert check.status == status, check
    assert all(word in check.detail for word in detail), check.detail
    assert all(word in check.fix for word in fix), check.fix
    assert check.evidence


def test_driver_forced_into_direct_p2p_is_ok():
    check = checks_of("direct-forcep2p")["p2p_driver"]
    assert check.status == "ok" and "ForceP2P=0x11" in check.detail


def test_measured_probe_outranks_the_attachment_guess():
    fast = P2PSummary((0, 1), 52.0, 50.0, 2.1, 2.5, 0.9, 0.9, 0.9, False)
    slow = P2PSummary((0, 1), 3.4, 3.1, 9.0, 9.0, 0.9, 0.9, 0.9, False)
    assert checks_of("direct-staged", probe=fast)["p2p_driver"].status == "ok"
    staged = checks_of("healthy", probe=slow)["p2p_driver"]
    assert staged.status == "fail" and "measured 3.4 GB/s" in staged.detail


def test_the_staging_guess_is_made_for_sm12x_gpus_only():
    spec = _spec("direct-staged")
    spec["gpus"] = [{**g, "capability": [9, 0]} for g in spec["gpus"]]
    check = checks_of("direct-staged", nvml=FakeNvml(spec))["p2p_driver"]
    assert check.status == "unknown" and "reported for SM12x" in check.detail


def test_gpus_without_a_bridge_above_them_leave_the_attachment_unknown(tmp_path):
    root = tmp_path / "vm"
    shutil.copytree(FIXTURES / "direct-staged", root, symlinks=True)
    devices = root / "sys/bus/pci/devices"
    for bdf in ("0000:01:00.0", "0000:02:00.0"):  # as a VM shows passed-through GPUs
        flat = root / "sys/devices/pci0000:00" / bdf
        shutil.copytree((devices / bdf).resolve(), flat)
        (devices / bdf).unlink()
        (devices / bdf).symlink_to(flat)
    check = checks_of("direct-staged", root=root)["p2p_driver"]
    assert check.status == "unknown" and "virtual machine" in check.detail


def test_nvml_without_p2p_on_a_pair_fails_p2p_driver():
    spec = FakeNvml.of("healthy")
    spec._p2p_status = 2  # NVML_P2P_STATUS_CHIPSET_NOT_SUPPORED
    check = checks_of("healthy", nvml=spec)["p2p_driver"]
    assert check.status == "fail" and "no P2P between GPUs 0-1" in check.detail


def test_dual_socket_topology_is_a_matrix_like_nvidia_smi():
    check = checks_of("dual-socket")["topology"]
    assert check.matrix[0] == ("X", "PIX", "SYS", "SYS")
    assert [row[row_index] for row_index, row in enumerate(check.matrix)] == ["X"] * 4
    text = "\n".join(format_checks([check]))
    assert "GPU2  " in text and "SYS" in text and "cross sockets" in text


def test_without_a_gpu_the_gpu_checks_say_unknown_no_gpu():
    checks = run_host_checks(8, 7168, root=FIXTURES / "no-gpu", skip_nvml="no NVML here")
    by_name = {c.name: c for c in checks}
    for name in ("acs", "p2p_driver", "pcie_link", "bar1", "topology", "persistence"):
        assert by_name[name].status == "unknown", by_name[name]
        assert by_name[name].detail.startswith("no GPU ("), by_name[name].detail
    assert by_name["iommu"].status == "unknown"  # no /sys/class/iommu in this dump


def test_nvml_errors_make_a_check_unknown_with_the_error_text():
    nvml = FakeNvml.of("healthy", failing=("nvmlDeviceGetBAR1MemoryInfo",))
    check = checks_of("healthy", nvml=nvml)["bar1"]
    assert check.status == "unknown"
    assert "nvmlDeviceGetBAR1MemoryInfo: Unknown Error" in check.detail


def test_functions_missing_from_an_older_pynvml_make_a_check_unknown():
    nvml = FakeNvml.of("healthy", missing=("nvmlDeviceGetTopologyCommonAncestor",))
    check = checks_of("healthy", nvml=nvml)["topology"]
    assert check.status == "unknown" and "missing from this nvidia-ml-py" in check.detail
    old = FakeNvml.of("downtrained", missing=("nvmlDeviceGetGpuMaxPcieLinkGeneration",))
    assert "x8 of x16" in checks_of("downtrained", nvml=old)["pcie_link"].detail


def test_nvml_that_cannot_start_leaves_gpu_checks_unknown_and_shuts_nothing():
    nvml = FakeNvml.of("healthy", failing=("nvmlInit",))
    checks = checks_of("healthy", nvml=nvml)
    assert checks["bar1"].status == "unknown" and "nvmlInit" in checks["bar1"].detail
    assert nvml.initialised == 0


def test_nvml_is_shut_down_after_the_checks():
    nvml = FakeNvml.of("healthy")
    checks_of("healthy", nvml=nvml)
    assert nvml.initialised == 0


def test_one_gpu_has_no_peers_to_judge():
    nvml = FakeNvml({**_spec("healthy"), "gpus": _spec("healthy")["gpus"][:1]})
    checks = checks_of("healthy", nvml=nvml, tp=1)
    assert checks["p2p_driver"].status == "unknown" and "one GPU" in checks["p2p_driver"].detail
    assert checks["topology"].status == "unknown"
    assert checks["bar1"].status == "ok" and "TP1" in checks["bar1"].detail


def _spec(case: str) -> dict:
    return json.loads((FIXTURES / case / "nvml.json").read_text())


def _fixture_builder():
    spec = importlib.util.spec_from_file_location("host_fixture_build", FIXTURES / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_acs_control_walks_the_extended_capability_list():
    build = _fixture_builder()
    ACS_REDIRECT, config_space = build.ACS_REDIRECT, build.config_space

    assert acs_control(config_space(0x1000, ACS_REDIRECT)) == ACS_REDIRECT
    assert acs_control(config_space(0x1000, None)) is None  # AER only, no ACS
    with pytest.raises(Exception, match="64 bytes"):
        acs_control(config_space(0x1000, ACS_REDIRECT, length=64))
    looped = bytearray(config_space(0x1000, None))
    looped[0x100:0x104] = (0x0001 | (0x100 << 20)).to_bytes(4, "little")  # next = itself
    assert acs_control(bytes(looped)) is None


def test_registry_dwords_are_read_from_the_params_file():
    params = 'EnableMSI: 1\nRegistryDwords: "ForceP2P=0x11;EnableResizableBar=1"\nRmMsg: ""\n'
    assert registry_dwords(params) == {"ForceP2P": "0x11", "EnableResizableBar": "1"}
    assert registry_dwords('RegistryDwords: ""\n') == {}


def test_sysfs_root_comes_from_its_variable(monkeypatch):
    monkeypatch.setenv(SYSFS_ROOT_ENV, str(FIXTURES / "acs-on"))
    assert sysfs_root() == FIXTURES / "acs-on"
    checks = {c.name: c for c in run_host_checks(8, 7168, skip_nvml="test")}
    assert checks["acs"].status == "fail"  # GPUs found in sysfs without NVML
    monkeypatch.delenv(SYSFS_ROOT_ENV)
    assert str(sysfs_root()) == "/"


def test_ipc_workspace_sizes_follow_the_upstream_layouts():
    sizes = ipc_workspace_bytes(tp=8, hidden=7168, decode_rows=256)
    payload = 256 * 7168 * 2
    # PCIe-IPC: 2 scratch regions of 2 N payloads, the copy-engine ring, 64 KiB of flags.
    assert sizes["pcie_ipc"] == 2 * 2 * 8 * payload + 7 * payload // 4 + (64 << 10)
    # trtllm at 2048 rows: a buffer of N x rows x hidden x 2 and 3 Lamport buffers of the same.
    comm = 8 * 2048 * 7168 * 2
    assert sizes["trtllm"] == comm + (2 << 20) + 3 * comm
    assert sizes["need"] == max(sizes["trtllm"], sizes["sm120_pcie"]) + sizes["pcie_ipc"]
    assert ipc_workspace_bytes(tp=2, hidden=7168)["need"] < sizes["need"]


def test_the_sm120_workspace_size_follows_the_bounds_a_server_reads(monkeypatch):
    """A one-shot bound raised through the environment grows the workspace every server rank
    allocates (3 N slots of the bound), so the BAR1 check must count it."""
    config = pytest.importorskip("sgl_kernel_sm120.config")
    monkeypatch.delenv("SGLANG_SM120_ONESHOT_MAX_BYTES", raising=False)
    default = ipc_workspace_bytes(tp=8, hidden=7168, decode_rows=256)["sm120_pcie"]
    monkeypatch.setenv("SGLANG_SM120_ONESHOT_MAX_BYTES", str(2 << 20))
    raised = ipc_workspace_bytes(tp=8, hidden=7168, decode_rows=256)
    tuning = config.resolve_tuning(8)
    layout = config.workspace_layout(
        8, 256 * 7168 * 2, tuning.oneshot_max_bytes, tuning.twoshot_lamport_max_bytes
    )
    assert raised["sm120_pcie"] == layout.total_bytes > default + 3 * 8 * (1 << 20)


# ---- issue 26.3: a source that cannot be read is "unknown", never "off"


def _copy(tmp_path, case: str):
    root = tmp_path / case
    shutil.copytree(FIXTURES / case, root, symlinks=True)
    return root


def test_iommu_units_absent_from_sysfs_is_unknown_not_off(tmp_path):
    """gVisor and some containers show no /sys/class/iommu while the host's IOMMU may be on."""
    root = _copy(tmp_path, "healthy")
    shutil.rmtree(root / "sys/class/iommu")
    check = checks_of("healthy", root=root)["iommu"]
    assert check.status == "unknown", check
    assert "/sys/class/iommu" in check.detail and "No such file" in check.detail, check.detail


def test_iommu_units_unlistable_is_unknown_with_the_reason(tmp_path, monkeypatch):
    import sglang_sm120.machine.host_checks as host_checks

    listdir = host_checks.os.listdir

    def denied(path):
        if str(path).endswith("sys/class/iommu"):
            raise PermissionError(13, "Permission denied", str(path))
        return listdir(path)

    monkeypatch.setattr(host_checks.os, "listdir", denied)
    check = checks_of("healthy")["iommu"]
    assert check.status == "unknown" and "Permission denied" in check.detail, check


def test_iommu_class_present_and_empty_is_off(tmp_path):
    root = _copy(tmp_path, "healthy")
    shutil.rmtree(root / "sys/class/iommu")
    (root / "sys/class/iommu").mkdir()
    check = checks_of("healthy", root=root)["iommu"]
    assert check.status == "ok" and "no IOMMU units" in check.detail, check


def test_iommu_absent_but_off_on_the_kernel_command_line_is_off(tmp_path):
    root = _copy(tmp_path, "healthy")
    shutil.rmtree(root / "sys/class/iommu")
    (root / "proc/cmdline").write_text("BOOT_IMAGE=/vmlinuz ro intel_iommu=off\n")
    check = checks_of("healthy", root=root)["iommu"]
    assert check.status == "ok" and "intel_iommu=off" in check.detail, check


def test_a_bridge_config_that_cannot_be_read_leaves_acs_unknown_not_ok(tmp_path):
    root = _copy(tmp_path, "healthy")
    config = (root / "sys/bus/pci/devices/0000:02:00.0").resolve() / "config"
    config.unlink()
    check = checks_of("healthy", root=root)["acs"]
    assert check.status == "unknown" and "0000:02:00.0" in check.detail, check


# ---- issue 26.4: pcie_link against the platform's maximum, under load


def _with_gpus(case: str, **changes) -> FakeNvml:
    spec = _spec(case)
    spec["gpus"] = [{**g, **changes} for g in spec["gpus"]]
    return FakeNvml(spec)


def test_gen5_gpus_at_a_gen4_platforms_maximum_are_ok():
    """NVML's MaxPcieLinkGeneration is what device and system both do: 4 on a Gen4 platform."""
    nvml = _with_gpus("healthy", gen=4, max_gen=4, gpu_max_gen=5, pstate=0)
    check = checks_of("healthy", nvml=nvml)["pcie_link"]
    assert check.status == "ok", check
    assert "Gen4 x16" in check.detail and "platform" in check.detail, check.detail


def test_a_link_below_its_maximum_under_load_is_downtrained():
    nvml = _with_gpus("healthy", gen=3, max_gen=5, gpu_max_gen=5, pstate=0)
    check = checks_of("healthy", nvml=nvml)["pcie_link"]
    assert check.status == "fail", check
    assert "GPU0 at Gen3 of Gen5 while busy (P0)" in check.detail, check.detail


def test_an_idle_link_downclocked_for_power_saving_is_not_flagged():
    nvml = _with_gpus("healthy", gen=1, max_gen=5, gpu_max_gen=5, pstate=8)
    check = checks_of("healthy", nvml=nvml)["pcie_link"]
    assert check.status == "ok" and "idle power saving" in check.detail, check


# ---- issue 26.2: findings about the TP group's GPUs only


def test_checks_judge_only_the_tp_groups_gpus():
    whole = checks_of("split-switch-root", tp=4)
    assert {whole[n].status for n in ("p2p_driver", "pcie_link", "persistence")} != {"ok"}
    group = checks_of("split-switch-root", tp=2, gpu_ids=(0, 1))
    assert {c.status for c in group.values()} == {"ok"}, group
    assert all("GPUs 0,1" in c.detail for c in group.values()), group
    other = checks_of("split-switch-root", tp=2, gpu_ids=(2, 3))
    assert other["p2p_driver"].status == "fail" and "GPUs 2,3" in other["p2p_driver"].detail
    assert "0000:05:00.0" in other["p2p_driver"].detail
    assert "GPU2 runs x8 of x16" in other["pcie_link"].detail
    assert "GPUs 3" in other["persistence"].detail
    assert other["topology"].matrix == (("X", "PHB"), ("PHB", "X"))
    assert "GPU2  GPU3" in "\n".join(format_checks([other["topology"]]))


def test_without_nvml_the_tp_groups_gpus_are_taken_in_pci_order():
    group = checks_of("split-switch-root", tp=2, gpu_ids=(0, 1), skip_nvml="a profile")
    assert group["p2p_driver"].status == "ok" and "0000:04:00.0" in group["p2p_driver"].detail
    other = checks_of("split-switch-root", tp=2, gpu_ids=(2, 3), skip_nvml="a profile")
    assert other["p2p_driver"].status == "fail" and "0000:06:00.0" in other["p2p_driver"].detail


def test_gpu_ids_past_the_visible_gpus_leave_the_gpu_checks_unknown():
    checks = checks_of("healthy", tp=2, gpu_ids=(2, 3))
    for name in ("p2p_driver", "pcie_link", "bar1", "topology", "persistence"):
        assert checks[name].status == "unknown" and "GPUs 2,3" in checks[name].detail
