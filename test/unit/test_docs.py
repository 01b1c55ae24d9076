"""What a user reads: every variable the code reads is documented, every CLI option has help.

The variables are found by scanning the source, not listed here, so a new one fails this test
until a page under docs/ (or README.md) names it.
"""

from __future__ import annotations

import argparse
import ast
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = (ROOT / "python", ROOT / "sgl-kernel-sm120" / "python")
BUILD_FILES = (ROOT / "sgl-kernel-sm120" / "CMakeLists.txt",)
VARIABLE = re.compile(r"SGLANG_SM120_[A-Z0-9_]+")


def docs_text() -> str:
    """README.md and every page under docs/."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return "\n".join(page.read_text() for page in pages)


def string_literals(path: Path) -> Iterator[str]:
    """Every string constant in a Python file: plain, docstring, or a part of an f-string."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


def variables_read() -> dict[str, set[str]]:
    """SGLANG_SM120_* name -> the files (relative to the repository) that name it."""
    found: dict[str, set[str]] = {}
    texts = [
        (path, literal)
        for directory in SOURCE_DIRS
        for path in sorted(directory.rglob("*.py"))
        for literal in string_literals(path)
    ]
    texts += [(path, path.read_text()) for path in BUILD_FILES]
    for path, text in texts:
        for name in VARIABLE.findall(text):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def documented(name: str, text: str) -> bool:
    """The whole name appears (SGLANG_SM120_E2E_TP does not document SGLANG_SM120_E2E_T)."""
    return re.search(rf"(?<![A-Z0-9_]){re.escape(name)}(?![A-Z0-9_])", text) is not None


def test_the_scan_finds_the_variables_we_know_of():
    found = variables_read()
    for name in ("SGLANG_SM120_DISABLE", "SGLANG_SM120_TIMEOUT_MS", "SGLANG_SM120_CUDA_ARCHS"):
        assert name in found, name
    assert len(found) >= 20, sorted(found)


def test_every_variable_the_code_reads_is_documented():
    text = docs_text()
    missing = {
        name: sorted(files)
        for name, files in variables_read().items()
        if not documented(name, text)
    }
    assert not missing, f"not in docs/ or README.md: {missing}"


def test_a_name_is_documented_only_when_it_appears_whole():
    assert documented("SGLANG_SM120_TP", "set `SGLANG_SM120_TP=2`")
    assert not documented("SGLANG_SM120_T", "set `SGLANG_SM120_TP=2`")
    assert not documented("SGLANG_SM120_TP", "set `SGLANG_SM120_TP2=2`")


def test_every_page_under_docs_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{page.name})" in readme, page.name


def test_every_relative_link_in_the_docs_points_to_a_file():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = [
        f"{page.relative_to(ROOT)}: {link}"
        for page in pages
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text())
        if "://" not in link and not (page.parent / link).exists()
    ]
    assert broken == []


def test_the_readme_is_short_and_starts_with_a_command():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    first_fence = next(i for i, line in enumerate(lines) if line.startswith("```"))
    assert first_fence < 40, first_fence


def test_the_readme_keeps_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert (
        "pip install ./sgl-kernel-sm120 . && sglang-sm120 plan --profile rtx-pro-6000-x8-pcie "
        "--tp 8 --model-arch KimiK25ForConditionalGeneration"
    ) in readme
    test_command = 'pip install ./sgl-kernel-sm120 ".[test]" && python -m pytest -n 2 test'
    assert test_command in readme


def code_blocks(text: str) -> list[str]:
    """The contents of every fenced code block, in order."""
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def test_the_readmes_first_command_installs_from_the_checkout_in_a_venv():
    """A newcomer runs the first block: it must work today (the packages are not on PyPI)."""
    first = code_blocks((ROOT / "README.md").read_text())[0]
    assert "python3 -m venv .venv && . .venv/bin/activate" in first
    assert re.search(r"^pip install \./sgl-kernel-sm120 \.$", first, flags=re.MULTILINE), first
    assert "pip install sglang-sm120" not in first


def test_the_readme_names_the_python_the_package_requires():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    version = project["requires-python"].removeprefix(">=")
    assert f"Python >= {version}" in (ROOT / "README.md").read_text()


def dict_keys(node: ast.AST) -> list[str]:
    return [key.value for key in node.keys if isinstance(key, ast.Constant)]


def doctor_json_keys() -> list[str]:
    """The top-level keys of `doctor --json`, read from the source: the `report` dict in
    commands/doctor.py's run() and the dict plugin_check.plugin_state() returns (merged in)."""
    commands = ROOT / "python/sglang_sm120/commands"

    def functions(name: str) -> dict[str, ast.FunctionDef]:
        tree = ast.parse((commands / name).read_text())
        return {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}

    keys = []
    for node in ast.walk(functions("doctor.py")["run"]):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "report":
            keys += dict_keys(node.value)
    for node in ast.walk(functions("plugin_check.py")["plugin_state"]):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Dict):
            keys += dict_keys(node.value)
    return keys


def test_every_doctor_json_key_is_in_commands_md():
    keys = doctor_json_keys()
    assert {"sglang_sm120", "patches", "validation_mode", "p2p_probe"} <= set(keys), keys
    listing = (ROOT / "docs" / "commands.md").read_text().split("`doctor --json` keys:")[1]
    listing = listing.split("\n\n")[0]
    assert [key for key in keys if f"`{key}`" not in listing] == []


def test_every_facts_key_is_in_commands_md():
    from sglang_sm120.machine.facts import load_profile

    row = next(
        line
        for line in (ROOT / "docs" / "commands.md").read_text().splitlines()
        if line.startswith("| `facts` |")
    )
    keys = load_profile("rtx-pro-6000-x8-pcie").to_json()
    assert [key for key in keys if f"`{key}`" not in row] == []


def helps(parser: argparse.ArgumentParser, command: str) -> Iterator[tuple[str, str | None]]:
    """(what, its help text) for every option and subcommand, subcommands' options included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            texts = {choice.dest: choice.help for choice in action._choices_actions}
            for name, subparser in action.choices.items():
                yield f"{command} {name}", texts.get(name)
                yield from helps(subparser, f"{command} {name}")
        else:
            yield f"{command} {'/'.join(action.option_strings) or action.dest}", action.help


def cli_helps() -> dict[str, str | None]:
    from sglang_sm120.commands.cli import build_parser

    return dict(helps(build_parser(), "sglang-sm120"))


def test_the_walk_reaches_every_subcommand_and_selftests_own_flags():
    found = cli_helps()
    for command in ("doctor", "plan", "tune", "warmup", "profiles", "selftest"):
        assert f"sglang-sm120 {command}" in found, command
    assert "sglang-sm120 selftest --keep-logs" in found
    assert "sglang-sm120 doctor --capability" in found
    assert "sglang-sm120 tune --replays" in found


def test_every_cli_option_and_subcommand_has_help():
    unhelped = [
        what
        for what, text in cli_helps().items()
        if not (text or "").strip() or text == argparse.SUPPRESS
    ]
    assert unhelped == []


def test_every_option_of_every_command_is_in_the_docs():
    """`--help` is not the only place an option is explained (`p2p --reps` once was)."""
    text = docs_text()
    missing = []
    for what in cli_helps():
        names = [o for o in what.rsplit(" ", 1)[1].split("/") if o.startswith("--")]
        if names and "--help" not in names:
            if not any(re.search(rf"{re.escape(o)}(?![\w-])", text) for o in names):
                missing.append(what)
    assert missing == []


USER_NCCL_TUNING_LIST = re.compile(r"<!-- user-nccl-tuning -->(.*?)<!-- /user-nccl-tuning -->")


def test_every_list_of_the_nccl_variables_that_keep_the_tuned_variant_off_is_the_codes():
    """Each page that lists the NCCL variables whose setting keeps ``nccl_env.set`` empty
    (``USER_NCCL_TUNING``) marks the list, and the list is the code's, in its order: a name
    added to the code (NCCL_TUNER_PLUGIN once was) fails here until the pages say it."""
    from sglang_sm120.planning.nccl_settings import USER_NCCL_TUNING

    expected = ", ".join(f"`{name}`" for name in USER_NCCL_TUNING)
    pages = {p: p.read_text() for p in (ROOT / "docs").glob("*.md")}
    lists = {p.name: USER_NCCL_TUNING_LIST.findall(text) for p, text in pages.items()}
    assert {"commands.md", "routing.md", "configuration.md"} <= {n for n, f in lists.items() if f}
    assert {name: found for name, found in lists.items() if set(found) - {expected}} == {}


KIMI_ARCH = "KimiK25ForConditionalGeneration"


def test_the_readmes_plan_sample_is_what_plan_prints(capsys, monkeypatch):
    """The README's `plan` sample is the command's output from the plan line on, all-reduce
    options included (it once stopped before them); plan imports no SGLang: in-process."""
    from sglang_sm120.commands.cli import main

    for name in ("SGLANG_SM120_FUSION_BACKEND", "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"):
        monkeypatch.delenv(name, raising=False)
    command = "plan --profile rtx-pro-6000-x8-pcie --tp 8 --model-arch " + KIMI_ARCH
    assert f"sglang-sm120 {command}" in (ROOT / "README.md").read_text()
    assert main(command.split()) == 0
    printed = capsys.readouterr().out
    sample = next(b for b in code_blocks((ROOT / "README.md").read_text()) if "plan for tp=8" in b)
    assert "all-reduce options" in sample
    assert printed[printed.index("plan for tp=8") :] == sample
