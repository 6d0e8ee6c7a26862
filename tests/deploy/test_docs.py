"""The README and docs/ stay true: every link resolves, every `vgpu` command
shown parses with the real command line, and the README's test command is
exactly what .ci/run runs."""

from __future__ import annotations

import itertools
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from vgpu.cli.main import _parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)")


def _outside_code(text: str) -> str:
    """The page without its fenced code blocks (links in code are not links)."""
    out, in_code = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_code = not in_code
            continue
        if not in_code:
            out.append(line)
    return "\n".join(out)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for line in _outside_code(path.read_text()).splitlines():
        match = re.match(r"^#{1,6} (.+)$", line)
        if match:
            slug = _slug(match.group(1))
            count = seen.get(slug, 0)
            anchors.add(slug if count == 0 else f"{slug}-{count}")
            seen[slug] = count + 1
    return anchors


def _links() -> list[tuple[Path, str]]:
    found = []
    for page in PAGES:
        for target in LINK.findall(_outside_code(page.read_text())):
            if not re.match(r"^[a-z]+://", target) and not target.startswith("mailto:"):
                found.append((page, target))
    return found


@pytest.mark.parametrize(
    ("page", "target"), _links(), ids=lambda v: v.name if isinstance(v, Path) else str(v)
)
def test_every_relative_link_resolves(page: Path, target: str) -> None:
    file_part, _, anchor = target.partition("#")
    dest = (page.parent / file_part).resolve() if file_part else page
    assert dest.exists(), f"{page.relative_to(ROOT)} links to missing {target}"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest), f"{page.relative_to(ROOT)}: no heading #{anchor} in {dest}"


def _commands_of(text: str) -> list[list[str]]:
    """The simple commands of one shell line, split at ;, &&, || and |."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # output or prose in a shell block, not a command line
        assert not re.match(r"^\s*vgpu\s", text), f"unparsable vgpu command: {text}"
        return []
    commands: list[list[str]] = [[]]
    for token in tokens:
        if token and set(token) <= set(";&|()<>"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def _code_lines(page: Path, langs: tuple[str, ...] | None = None) -> Iterator[str]:
    """The command lines of the page's code blocks (of `langs` only, when given),
    continuation lines joined and a `$ ` prompt removed."""
    lang, in_code, pending = "", False, ""
    for line in page.read_text().splitlines():
        fence = FENCE.match(line.strip())
        if fence:
            in_code, pending = not in_code, ""
            lang = fence.group(1) if in_code else ""
            continue
        if not in_code or (langs is not None and lang not in langs):
            continue
        text = pending + line.strip()
        if text.endswith("\\"):
            pending = text[:-1] + " "
            continue
        pending = ""
        yield text.removeprefix("$ ")


def _vgpu_commands() -> list[tuple[str, str]]:
    """Every `vgpu ...` command line in a shell block of the docs."""
    commands = []
    for page in PAGES:
        for text in _code_lines(page, ("sh", "bash", "console", "")):
            for words in _commands_of(text):
                if "--" in words:  # kubectl exec ... -- vgpu status
                    words = words[words.index("--") + 1 :]
                while words and "=" in words[0] and not words[0].startswith("-"):
                    words = words[1:]  # VAR=value prefixes
                if words and words[0] in ("vgpu", ".venv/bin/vgpu"):
                    commands.append((page.relative_to(ROOT).as_posix(), shlex.join(words[1:])))
    return commands


COMMANDS = _vgpu_commands()


def test_the_docs_show_vgpu_commands() -> None:
    assert len(COMMANDS) >= 5, COMMANDS


@pytest.mark.parametrize(("page", "args"), COMMANDS)
def test_every_vgpu_command_in_the_docs_parses(page: str, args: str) -> None:
    words = shlex.split(args)
    try:
        _parser().parse_args(words)
    except SystemExit as exc:  # argparse's way of refusing
        if words == ["--version"] and exc.code == 0:
            return
        pytest.fail(f"{page}: `vgpu {args}` does not parse (exit {exc.code})")


def test_readme_test_command_is_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (ROOT / "README.md").read_text()
    assert ci in readme


def test_readme_stays_short_and_points_at_every_docs_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme, f"README does not link docs/{page.name}"


# ------------------------------------------- Helm commands in the docs


def _helm_commands(page: Path) -> list[list[str]]:
    """Every `helm install|upgrade|template` command line in the page's shell blocks."""
    found: list[list[str]] = []
    for text in _code_lines(page):
        for words in _commands_of(text):
            if words[:1] == ["helm"] and words[1:2] in (["install"], ["upgrade"], ["template"]):
                found.append(words)
    return found


def _set_values(words: list[str]) -> dict[str, object]:
    """The values a helm command's --set flags give, nested and typed as Helm does
    (true/false become booleans, digits integers, everything else a string)."""
    values: dict[str, object] = {}
    for flag, arg in itertools.pairwise(words):
        if flag != "--set":
            continue
        key, _, text = arg.partition("=")
        value: object = {"true": True, "false": False}.get(text, text)
        if text.isdigit():
            value = int(text)
        node = values
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            assert isinstance(child, dict), key
            node = child
        node[leaf] = value
    return values


def test_try_without_gpus_installs_the_mock_backend_with_helm(tmp_path: Path) -> None:
    # The page's Helm commands render with the real chart into a daemon config
    # that loads and selects the mock backend; nothing there tells a Helm user
    # to edit the release's ConfigMap (the next helm upgrade would undo it).
    import importlib.util

    import yaml

    from vgpu import config

    spec = importlib.util.spec_from_file_location("render_for_docs", ROOT / "deploy" / "render.py")
    assert spec and spec.loader
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)

    page = ROOT / "docs" / "try-without-gpus.md"
    commands = _helm_commands(page)
    assert [c[1] for c in commands][:1] == ["install"], commands
    rendered = 0
    for words in commands:
        if "--reuse-values" in words:
            continue  # an upgrade of the install above
        docs = [yaml.safe_load(d) for d in render.render(_set_values(words))]
        (cm,) = [o for o in docs if o["metadata"]["name"] == "vgpu-config"]
        path = tmp_path / "config.yaml"
        path.write_text(cm["data"]["config.yaml"])
        settings = config.load({}, {}, path)
        assert (str(settings.backend), str(settings.mock_gpus)) == ("mock", "preset:2xH200")
        rendered += 1
    assert rendered == 2  # helm install and helm template
    assert "edit cm" not in page.read_text()
