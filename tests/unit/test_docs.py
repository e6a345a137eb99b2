"""The docs hold together: every relative link resolves (file and anchor), the README stays a short
manual, every `pdserve COMMAND` it names exists, and docs/configuration.md names every flag of
every command."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from pdserve.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
README_MAX_LINES = 150

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE_BLOCK = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.MULTILINE)


def prose(path: Path) -> str:
    return CODE_BLOCK.sub("", path.read_text())


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {anchor(h) for h in HEADING.findall(prose(path))}


def relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path)) if not re.match(r"^[a-z]+:", t)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    broken = []
    for target in relative_links(doc):
        file, _, fragment = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: {broken}"


def test_anchor_follows_github():
    assert anchor("Adaptive placement (WRITE mode): D decides where each prompt is prefilled") == \
        "adaptive-placement-write-mode-d-decides-where-each-prompt-is-prefilled"
    assert anchor("Decode-heavy traffic (ISL 128 / OSL 512)") == "decode-heavy-traffic-isl-128--osl-512"


def test_readme_is_a_short_manual():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES
    text = "\n".join(lines)
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh"):  # the two set-up commands stay
        assert command in text


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_command_the_readme_names_exists():
    text = (ROOT / "README.md").read_text()
    named = set(re.findall(r"`pdserve ([a-z][a-z-]*)", text))  # inline code
    named |= set(re.findall(r"^pdserve ([a-z][a-z-]*)", "\n".join(CODE_BLOCK.findall(text)), re.MULTILINE))
    assert named <= set(commands()), f"not commands: {sorted(named - set(commands()))}"
    assert {"up", "demo", "instance", "router", "bench", "bench-pair", "make-model"} <= named


def test_configuration_names_every_flag_of_every_command():
    text = (ROOT / "docs" / "configuration.md").read_text()
    missing = []
    for name, parser in commands().items():
        for action in parser._actions:
            if action.help == argparse.SUPPRESS:
                continue
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help" and f"`{flag}" not in text:
                    missing.append(f"pdserve {name} {flag}")
    assert not missing, f"docs/configuration.md does not name: {missing}"
