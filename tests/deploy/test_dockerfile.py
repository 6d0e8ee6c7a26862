"""The Dockerfile's structural contract, checked from its text (no Docker engine needed)."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
CONFIGMAP = ROOT / "deploy" / "03-configmap.yaml"


def _instructions(text: str | None = None) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in (DOCKERFILE.read_text() if text is None else text).splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def _args() -> dict[str, str]:
    """Default values of ARGs declared before the first FROM."""
    defaults: dict[str, str] = {}
    for word, rest in _instructions():
        if word == "FROM":
            break
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            defaults[name] = value
    return defaults


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for word, rest in _instructions():
        if word == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((word, rest))
    return stages


def _base_images() -> list[str]:
    defaults = _args()
    images = []
    for stage in _stages():
        image = stage[0][1].split()[0]
        images.append(re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], image))
    return images


def _hook_library_path() -> str:
    configmap = yaml.safe_load(CONFIGMAP.read_text())
    path: str = yaml.safe_load(configmap["data"]["config.yaml"])["hook_library"]
    return path


def test_two_stages_from_a_pinned_slim_python() -> None:
    images = _base_images()
    assert len(images) == 2
    for image in images:
        name, _, tag = image.partition(":")
        assert name == "python", image
        assert tag and tag != "latest", f"{image}: pin a version tag"
        assert tag.startswith("3.11-slim"), image


def test_build_stage_builds_the_hook_and_the_wheel() -> None:
    build = _stages()[0]
    assert " AS " in build[0][1].upper()
    runs = " ".join(rest for word, rest in build if word == "RUN")
    assert "build-essential" in runs
    assert "make -C hooks" in runs
    assert "pip wheel" in runs


def test_runtime_stage_has_no_compilers_and_installs_the_wheel() -> None:
    runtime = _stages()[1]
    text = " ".join(rest for _, rest in runtime)
    assert "build-essential" not in text and "gcc" not in text and "apt-get" not in text
    runs = " ".join(rest for word, rest in runtime if word == "RUN")
    assert "pip install" in runs and "--no-index" in runs


def test_the_hook_library_lands_where_the_configmap_looks() -> None:
    copies = [rest for word, rest in _stages()[1] if word == "COPY"]
    target = _hook_library_path()
    assert any(
        rest.startswith("--from=build ")
        and rest.split()[-2].endswith("hooks/build/libvgpu.so")
        and rest.split()[-1] == target
        for rest in copies
    ), copies


def test_entrypoint_and_default_args() -> None:
    runtime = dict(_stages()[1])
    assert json.loads(runtime["ENTRYPOINT"]) == ["vgpu", "serve"]
    assert json.loads(runtime["CMD"]) == ["--config", "/etc/vgpu/config.yaml"]
    assert runtime["USER"] == "root"
    assert "org.opencontainers.image.source" in runtime["LABEL"]


def test_nothing_is_fetched_by_add() -> None:
    for instruction, rest in _instructions():
        if instruction == "ADD":
            assert not re.search(r"https?://", rest), rest


def test_no_secrets_in_the_image() -> None:
    for instruction, rest in _instructions():
        if instruction in ("ENV", "ARG", "LABEL"):
            assert not re.search(r"(?i)(password|secret|token|api_?key)", rest), rest


def test_dockerignore_keeps_the_context_small() -> None:
    patterns = {
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    required = {".git", ".venv", "hooks/build", "build", "dist", ".pytest_cache", ".mypy_cache"}
    assert required <= patterns


# ------------------------------------------------------ offline, reproducible


def test_no_syntax_directive_that_fetches_a_frontend() -> None:
    # `# syntax=docker/dockerfile:1` makes BuildKit pull a frontend image from
    # Docker Hub before step 1: an offline or mirrored build fails there.
    for line in DOCKERFILE.read_text().splitlines():
        if not line.startswith("#"):
            break
        assert not re.match(r"#\s*syntax\s*=", line, re.IGNORECASE), line


def test_build_commands_name_buildkit() -> None:
    # RUN --mount needs BuildKit; Debian's Docker 20.10 builds without it by default.
    assert "--mount=" in DOCKERFILE.read_text()
    for path in (DOCKERFILE, ROOT / "docs" / "install.md"):
        commands = re.findall(
            r"^\W*(.*docker (?:buildx )?build .*)$", path.read_text(), re.MULTILINE
        )
        assert commands, f"{path.name} shows no build command"
        for command in commands:
            assert (
                "DOCKER_BUILDKIT=1 docker build" in command or "docker buildx build" in command
            ), f"{path.name}: {command}"


def test_both_pip_steps_use_the_constraints() -> None:
    build, runtime = _stages()
    for stage in (build, runtime):
        pips = [rest for word, rest in stage if word == "RUN" and "pip " in rest]
        assert pips
        for rest in pips:
            step = rest.split("&&")[0] if "pip install" in rest else rest
            assert re.search(r"-c \S*constraints\.txt", step), rest
    assert any(word == "COPY" and rest.split() == [".", "."] for word, rest in build), (
        "the build stage copies the repository, constraints.txt included"
    )


def test_runtime_drops_pip_and_caches_then_smoke_tests_the_dependencies() -> None:
    runs = " ".join(rest for word, rest in _stages()[1] if word == "RUN")
    assert re.search(r"pip uninstall --yes [^&]*\bpip setuptools wheel\b", runs)
    assert "--no-cache-dir" in runs
    imports = re.search(r'python -c "import ([^"]+)"', runs)
    assert imports, "no import smoke test"
    modules = {m.strip() for m in imports.group(1).split(",")}
    assert {
        "grpc",
        "google.protobuf",
        "kubernetes",
        "pynvml",
        "prometheus_client",
        "yaml",
    } <= modules
    assert "vgpu demo" in runs
    # Smoke tests run after pip is gone: they prove the runtime needs none of it.
    assert runs.index("pip uninstall") < runs.index("import grpc") < runs.index("vgpu demo")


# ------------------------------------------- mounts the same RUN cannot remove


def _run_mount_targets(rest: str) -> tuple[list[str], str]:
    """A RUN's --mount targets and the shell command after its flags."""
    targets: list[str] = []
    words = rest.split()
    while words and words[0].startswith("--"):
        flag = words.pop(0)
        if flag.startswith("--mount="):
            options = dict(
                option.partition("=")[::2] for option in flag[len("--mount=") :].split(",")
            )
            target = options.get("target") or options.get("dst") or options.get("destination")
            assert target, f"a --mount without a target: {flag}"
            targets.append(target.rstrip("/") or "/")
    return targets, " ".join(words)


def _removed_paths(command: str) -> list[str]:
    """Every path (or glob) that an `rm` in a shell command names."""
    removed: list[str] = []
    for step in re.split(r"&&|\|\||;", command):
        words = shlex.split(step)
        if words and words[0] == "rm":
            removed += [word.rstrip("/") or "/" for word in words[1:] if not word.startswith("-")]
    return removed


def _covers(pattern: str, path: str) -> bool:
    """True when removing `pattern` (a shell glob) removes `path` or a directory above it."""
    pattern_parts = pattern.strip("/").split("/")
    path_parts = path.strip("/").split("/")
    if len(pattern_parts) > len(path_parts):
        return False
    return all(fnmatch.fnmatchcase(p, g) for p, g in zip(path_parts, pattern_parts, strict=False))


def _removals_of_mount_targets(text: str) -> list[tuple[str, str]]:
    """(removed glob, mount target) pairs where a RUN removes its own mount."""
    found: list[tuple[str, str]] = []
    for word, rest in _instructions(text):
        if word != "RUN":
            continue
        targets, command = _run_mount_targets(rest)
        found += [
            (removed, target)
            for removed in _removed_paths(command)
            for target in targets
            if _covers(removed, target)
        ]
    return found


def test_no_run_removes_its_own_mount() -> None:
    # A bind mount cannot be removed from inside the RUN that mounts it:
    # buildah stops with "rm: cannot remove '/tmp/constraints.txt': Device or
    # resource busy", and BuildKit fails the same way (issue 29).
    assert _removals_of_mount_targets(DOCKERFILE.read_text()) == []


def test_the_mount_check_sees_the_issue_29_dockerfile() -> None:
    # The runtime RUN as it was when issue 29 found it: the check must refuse it.
    broken = (
        "FROM python:3.11-slim-bookworm\n"
        "RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \\\n"
        "    --mount=type=bind,from=build,source=/src/constraints.txt,"
        "target=/tmp/constraints.txt \\\n"
        "    pip install --no-index --find-links=/wheels -c /tmp/constraints.txt vgpu \\\n"
        "    && rm -rf /tmp/* /root/.cache\n"
    )
    assert _removals_of_mount_targets(broken) == [("/tmp/*", "/tmp/constraints.txt")]
    # Removing a directory above the target, or the target itself, is refused too;
    # a sibling is not.
    assert _covers("/tmp", "/tmp/constraints.txt")
    assert _covers("/wheels", "/wheels")
    assert not _covers("/tmp/vgpu-default.yaml", "/tmp/constraints.txt")
    assert not _covers("/root/.cache", "/wheels")
