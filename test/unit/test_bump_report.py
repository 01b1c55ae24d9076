"""The bump report on a planted sglang tree: every declared symbol in place but one that moved,
one copied table changed, two others equal, the rest unreadable; the report names each, the
patch whose seam is gone and the version gate, and exits 1."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from sglang_sm120.planning.policy import PCIE_IPC_WORLD_SIZES
from sglang_sm120.planning.upstream import FLAG_CHOICES, FUSION_ARCHS, PCIE_IPC_GROUPS
from sglang_sm120.server import bump_report
from sglang_sm120.server.contract import Symbol
from sglang_sm120.server.patches import PATCHES, workspace_preflight
from sglang_sm120.server.plugin import REGISTRY_CONTRACT, declared_contract

MOVED = workspace_preflight.TARGET
DROPPED_ARCH = "DeepseekV3ForCausalLM"
VALUES = {"bool": "False", "list": "[]", "dict": "{}", "int": "0", "str": "''", "tuple": "()"}
# What every patch module imports from the registry module when it is imported.
HOOK_TYPE = "class HookType:\n    BEFORE, AFTER, AROUND, REPLACE = 'b', 'a', 'ar', 'r'\n"


def _split(target: str, installed: Path) -> tuple[str, list[str]]:
    """(the module's dotted name, the names inside it) by the installed sglang's files."""
    parts = target.split(".")
    here = installed.parent
    for i, part in enumerate(parts):
        if (here / part / "__init__.py").is_file():
            here = here / part
        elif (here / f"{part}.py").is_file():
            return ".".join(parts[: i + 1]), parts[i + 1 :]
        elif (here / part).is_dir():  # a namespace package (sglang.srt has no __init__.py)
            here = here / part
        else:
            return ".".join(parts[:i]), parts[i:]
    raise AssertionError(f"{target} names a package")


def _definition(symbol: Symbol, name: str, indent: str) -> list[str]:
    if symbol.kind == "attribute":
        value = VALUES.get(symbol.type_name or "", "None")
        if symbol.type_name and symbol.type_name not in VALUES:
            kind = f"_{symbol.type_name}"
            return [f"{indent}class {kind}: pass", f"{indent}{name} = {kind}()"]
        return [f"{indent}{name} = {value}"]
    params = ", ".join(symbol.params) if symbol.params is not None else "*args, **kwargs"
    reads = ", ".join(symbol.reads) or "None"
    return [f"{indent}def {name}({params}):", f"{indent}    return ({reads},)"]


def plant_tree(root: Path) -> None:
    """An sglang 0.5.99 whose modules define every declared symbol as the contract says, but
    ``MOVED``; its fusion-architecture table lacks one; its flag choices and PCIe-IPC tables
    are ours; nothing else is there."""
    installed = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    modules: dict[str, dict[str, list[str]]] = {}  # module -> class ("" = module level) -> lines
    strictest: dict[str, Symbol] = {}  # two patches may declare one target, one more fully
    for symbol in declared_contract(PATCHES):
        known = strictest.get(symbol.target)
        if known is None or (known.params is None and symbol.params is not None):
            strictest[symbol.target] = symbol
    for symbol in strictest.values():
        if symbol.target == MOVED:
            continue
        module, names = _split(symbol.target, installed)
        assert len(names) in (1, 2), symbol.target
        owner = "" if len(names) == 1 else names[0]
        indent = "" if len(names) == 1 else "    "
        modules.setdefault(module, {}).setdefault(owner, []).extend(
            _definition(symbol, names[-1], indent)
        )
    archs = sorted(FUSION_ARCHS - {DROPPED_ARCH})
    extra = {
        "sglang": "__version__ = '0.5.99'",
        "sglang.srt.arg_groups.overrides": (
            f"_FLASHINFER_ALLREDUCE_FUSION_ARCHS = frozenset({archs!r})"
        ),
        "sglang.srt.server_args": "class ServerArgs:\n    @staticmethod\n"
        "    def add_cli_args(parser):\n"
        + "\n".join(
            f"        parser.add_argument({flag!r}, choices={list(choices)!r})"
            for flag, choices in FLAG_CHOICES.items()
        ),
        "sglang.srt.distributed.device_communicators.pcie_ipc_ar": (
            f"_SUPPORTED_WORLD_SIZES = {PCIE_IPC_WORLD_SIZES!r}\n"
            f"_ELIGIBLE_GROUP_NAMES = frozenset({sorted(PCIE_IPC_GROUPS)!r})"
        ),
        "sglang.srt.plugins.hook_registry": HOOK_TYPE,
    }
    for module, text in extra.items():
        modules.setdefault(module, {}).setdefault("", []).append(text)
    for module, owners in modules.items():
        parts = module.split(".")
        for depth in range(1, len(parts) + 1):
            package = root.joinpath(*parts[:depth])
            if (installed.parent.joinpath(*parts[:depth]) / "__init__.py").is_file():
                package.mkdir(parents=True, exist_ok=True)
                (package / "__init__.py").touch()
        root.joinpath(*parts[:-1]).mkdir(parents=True, exist_ok=True)
        is_package = (installed.parent.joinpath(*parts) / "__init__.py").is_file()
        path = (
            root.joinpath(*parts, "__init__.py")
            if is_package
            else root.joinpath(*parts[:-1], f"{parts[-1]}.py")
        )
        lines = list(owners.pop("", []))
        for owner, body in owners.items():
            lines += [f"class {owner}:", *body]
        path.write_text("\n".join(lines) + "\n")


def test_the_report_names_the_moved_symbol_the_changed_table_the_seam_and_the_gate(
    tmp_path, capsys
):
    tree = tmp_path / "sglang-0.5.99"
    plant_tree(tree)
    out = ["--out", str(tmp_path / "r.md"), "--json-out", str(tmp_path / "r.json")]
    code = bump_report.main(["--against", str(tree), "--json", *out])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["moved"] is True
    assert report["sglang_version"] == "0.5.99"
    assert Path(report["sglang_path"]) == tree / "sglang"  # the planted tree, not the installed
    assert report["version_gate"]["passes"] is False
    assert "applies nothing until the pin" in report["version_gate"]["note"]
    problems = [p for seam in report["patches"].values() for p in seam["problems"]]
    assert problems == [p for p in problems if p.startswith(f"{MOVED}: not found")]
    assert len(problems) == 1, problems  # every other declared symbol is where it was
    assert report["patches"]["workspace_preflight"]["seam"] == "gone"
    assert report["symbols_declared"] == len(declared_contract(PATCHES))
    tables = report["tables"]
    assert tables["FUSION_ARCHS"] == [f"FUSION_ARCHS: upstream no longer has ['{DROPPED_ARCH}']"]
    assert tables["FLAG_CHOICES"] == [] and tables["PCIE_IPC_*"] == []
    unread = {name: d for name, d in tables.items() if d and name != "FUSION_ARCHS"}
    assert unread and all(d[0].startswith(f"{name}: cannot read") for name, d in unread.items())
    assert json.loads((tmp_path / "r.json").read_text()) == report
    text = (tmp_path / "r.md").read_text()
    assert f"- {MOVED}: not found" in text and "| workspace_preflight | gone |" in text
    assert "- FUSION_ARCHS: DIFFERS" in text and "- FLAG_CHOICES: equal" in text
    assert len(REGISTRY_CONTRACT) == 2  # the loader's own two symbols were planted and matched


def test_a_path_without_sglang_is_one_line_and_exit_2(tmp_path, capsys):
    assert bump_report.main(["--against", str(tmp_path)]) == 2
    assert "no sglang/__init__.py" in capsys.readouterr().err
