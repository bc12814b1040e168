"""The README and the manual (docs/) name only what exists: links, headings, make targets, modules, paths.

Every relative link resolves to a file, and a `#anchor` to one of its headings (GitHub's slugs); every
`make <target>` is a target of the Makefile; every `python -m <module>` is importable; every repository path
in backticks exists; every table of figures sits in a section that names the command giving them; the
README's headline figures are the ones on the page they link to. Standard library and pytest only.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 250

TOP_FOLDERS = (
    "shared",
    "kernels",
    "gpu_worker",
    "gateway",
    "scheduler_svc",
    "benchmarks",
    "docker",
    "scripts",
    "docs",
    "tests",
)
PROJECT_PACKAGES = ("shared", "kernels", "gpu_worker", "gateway", "scheduler_svc")
# Written by the benchmarks when they run (git-ignored), so named before they exist.
GENERATED = ("benchmarks/results/",)
SHELL_LANGUAGES = ("bash", "sh", "shell", "console", "")

FENCE = re.compile(r"^ {0,3}(```+|~~~+)\s*([\w+-]*)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
MAKE = re.compile(r"(?:^|[\s;&|(])make\s+([A-Za-z][\w.-]*)")
PYTHON_M = re.compile(r"(?:^|[\s/;&|(])python3?\s+-m\s+([A-Za-z_][\w.]*)")
REPO_PATH = re.compile(r"(?<![\w./~$-])(?:" + "|".join(TOP_FOLDERS) + r")/[\w./*-]*(?:::[\w\[\]-]+)?")
TOP_FILE = re.compile(r"^(?:Makefile|[\w-]+\.(?:toml|ya?ml|cfg|ini))$")
# A measured figure: a decimal, or a number with a ratio or percent sign (not a version such as 2.13.0).
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:x|%)(?!\w)|(?<![\w.])\d+\.\d+(?![\w.])")
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")
COMMANDS = ("make", "python", "python3", ".venv/bin/python", "bash", "pytest", "redis-benchmark", "py-spy")
ENV_PREFIX = re.compile(r"^(?:(?:\w+=\S*|time)\s+)+")


@dataclass
class Block:
    """A fenced code block: its language and its lines."""

    language: str
    lines: list[str]


@dataclass
class Page:
    """A Markdown file split into prose (code blocks blanked, line numbers kept) and its code blocks."""

    path: Path
    lines: list[str]
    prose: list[str] = field(default_factory=list)
    blocks: list[tuple[int, Block]] = field(default_factory=list)  # (first line index, block)

    @classmethod
    def read(cls, path: Path) -> Page:
        page = cls(path, path.read_text(encoding="utf-8").splitlines())
        fence: str | None = None
        for i, line in enumerate(page.lines):
            match = FENCE.match(line)
            if fence is None and match:
                fence = match.group(1)
                page.blocks.append((i, Block(match.group(2).lower(), [])))
                page.prose.append("")
            elif fence is not None:
                if line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
                    fence = None
                else:
                    page.blocks[-1][1].lines.append(line)
                page.prose.append("")
            else:
                page.prose.append(line)
        assert fence is None, f"{page.name}: a code block is never closed"
        return page

    @property
    def name(self) -> str:
        return self.path.relative_to(ROOT).as_posix()

    def paragraphs(self, start: int = 0, stop: int | None = None) -> list[str]:
        """Prose between two line indexes, one string per paragraph (code spans may wrap a line)."""
        text = "\n".join(self.prose[start:stop])
        return [p for p in re.split(r"\n\s*\n", text) if p.strip()]

    def code_spans(self, start: int = 0, stop: int | None = None) -> list[str]:
        spans = []
        for paragraph in self.paragraphs(start, stop):
            spans += [" ".join(m.group(2).split()) for m in CODE_SPAN.finditer(paragraph)]
        return spans

    def shell_lines(self, start: int = 0, stop: int | None = None) -> list[str]:
        """The lines of the shell code blocks in a range, comments dropped."""
        stop = len(self.lines) if stop is None else stop
        out = []
        for first, block in self.blocks:
            if block.language in SHELL_LANGUAGES and start <= first < stop:
                out += [strip_comment(line) for line in block.lines]
        return [line for line in out if line.strip()]

    def commands(self, start: int = 0, stop: int | None = None) -> list[str]:
        """What may name a command: the code spans and the shell code blocks' lines."""
        return self.code_spans(start, stop) + self.shell_lines(start, stop)

    def links(self) -> list[str]:
        targets = []
        for paragraph in self.paragraphs():
            text = CODE_SPAN.sub("", paragraph).replace("\n", " ")
            targets += [m.group(2) for m in LINK.finditer(text)]
        return targets

    def headings(self) -> list[tuple[int, int, str]]:
        """(line index, level, title) of every heading outside code blocks."""
        matches = [(i, HEADING.match(line)) for i, line in enumerate(self.prose)]
        return [(i, len(m.group(1)), m.group(2)) for i, m in matches if m]

    def anchors(self) -> set[str]:
        """The anchors GitHub gives the headings, a repeated one suffixed -1, -2, ..."""
        seen: dict[str, int] = {}
        anchors = set()
        for _, _, title in self.headings():
            slug = github_slug(title)
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
        return anchors

    def sections(self, max_level: int = 3) -> list[tuple[str, int, int]]:
        """(title, first line, end line) of the text under each heading up to the next one of max_level."""
        marks = [(i, title) for i, level, title in self.headings() if level <= max_level]
        ends = [i for i, _ in marks[1:]] + [len(self.lines)]
        return [(title, i, end) for (i, title), end in zip(marks, ends)]


def strip_comment(line: str) -> str:
    """A shell line without its comment (a # at its start or after a space)."""
    return re.sub(r"(?:^|\s)#.*$", "", line)


def github_slug(title: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but hyphens dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def table_rows(lines: list[str]) -> list[str]:
    return [line for line in lines if line.lstrip().startswith("|")]


def is_command(text: str) -> bool:
    first = ENV_PREFIX.sub("", text.strip()).split(maxsplit=1)
    return bool(first) and first[0] in COMMANDS


def makefile_targets() -> set[str]:
    targets: set[str] = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        match = re.match(r"^([\w.$()/ -]+?)\s*::?(?!=)", line)
        if match and not line.startswith("\t"):
            targets.update(name for name in match.group(1).split() if "$" not in name)
        if line.startswith(".PHONY:"):
            targets.update(line.split(":", 1)[1].split())
    return targets


ALL_PAGES = [Page.read(path) for path in PAGES]
each_page = pytest.mark.parametrize("page", ALL_PAGES, ids=lambda page: page.name)


@pytest.mark.parametrize(
    ("title", "anchor"),
    [
        ("Against vLLM's CPU build", "against-vllms-cpu-build"),
        ("The control plane at scale (simulated workers)", "the-control-plane-at-scale-simulated-workers"),
        ("`gpu_worker/engine/`: the engine", "gpu_workerengine-the-engine"),
        ("Past one machine -- gateways", "past-one-machine----gateways"),
    ],
)
def test_anchors_follow_githubs_rule(title: str, anchor: str) -> None:
    assert github_slug(title) == anchor


def test_the_manual_exists() -> None:
    assert README.is_file()
    assert len(PAGES) > 1, "docs/ holds no page"


def test_the_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_the_readme_links_every_docs_page() -> None:
    linked = {(README.parent / target.split("#")[0]).resolve() for target in Page.read(README).links()}
    missing = [p.relative_to(ROOT).as_posix() for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"README.md links no page {missing}"


@each_page
def test_relative_links_resolve(page: Page) -> None:
    broken = []
    for target in page.links():
        if re.match(r"^[a-z][\w+.-]*:", target):  # https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        path = (page.path.parent / path_part).resolve() if path_part else page.path
        if not path.exists() or not path.is_relative_to(ROOT):
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in Page.read(path).anchors():
            broken.append(f"{target}: no heading #{anchor} in {path.relative_to(ROOT).as_posix()}")
    assert not broken, f"{page.name}: {broken}"


@each_page
def test_make_targets_exist(page: Page) -> None:
    targets = makefile_targets()
    named = {m.group(1) for text in page.commands() for m in MAKE.finditer(text)}
    unknown = sorted(named - targets)
    assert not unknown, f"{page.name} names make targets the Makefile lacks: {unknown}"


@each_page
def test_python_modules_resolve(page: Page) -> None:
    named = {m.group(1) for text in page.commands() for m in PYTHON_M.finditer(text)}
    missing = []
    for module in sorted(named):
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            missing.append(module)
    assert not missing, f"{page.name} runs `python -m` on modules that do not resolve: {missing}"


@each_page
def test_python_examples_parse_and_import(page: Page) -> None:
    """Each Python code block is valid Python, and what it imports from the project exists."""
    problems = []
    for first, block in page.blocks:
        if block.language not in ("python", "py"):
            continue
        try:
            tree = ast.parse("\n".join(block.lines))
        except SyntaxError as e:
            problems.append(f"line {first + 1 + (e.lineno or 0)}: {e.msg}")
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            if node.module.split(".")[0] in PROJECT_PACKAGES:
                try:
                    module = importlib.import_module(node.module)
                except ImportError as e:
                    problems.append(f"line {first + 1 + node.lineno}: {e}")
                    continue
                problems += [
                    f"line {first + 1 + node.lineno}: {node.module} has no {alias.name}"
                    for alias in node.names
                    if not hasattr(module, alias.name)
                    and importlib.util.find_spec(f"{node.module}.{alias.name}") is None
                ]
    assert not problems, f"{page.name}: {problems}"


def repo_paths(page: Page) -> set[str]:
    """Every repository path named in code: in code spans and in shell code blocks."""
    paths: set[str] = set()
    for text in page.commands():
        paths.update(m.group(0).split("::")[0].rstrip(".:,") for m in REPO_PATH.finditer(text))
    paths.update(span for span in page.code_spans() if TOP_FILE.match(span))
    return paths


@each_page
def test_repository_paths_exist(page: Page) -> None:
    missing = []
    for path in sorted(repo_paths(page)):
        if path.startswith(GENERATED):
            continue
        found = any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()
        if not found:
            missing.append(path)
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


@each_page
def test_tests_are_named_by_what_they_check(page: Page) -> None:
    """Test files move; the manual names the folder tests/ and `pytest -k` words, never a test file."""
    named = sorted(p for p in repo_paths(page) if re.match(r"^tests/(?:.*/)?test_\w*\.py$", p))
    assert not named, f"{page.name} names test files: {named}"


@each_page
def test_every_table_of_figures_names_its_command(page: Page) -> None:
    bare = []
    for title, start, end in page.sections():
        rows = table_rows(page.prose[start:end])
        figures = [f for row in rows for f in FIGURE.findall(CODE_SPAN.sub("", row))]
        if figures and not any(is_command(text) for text in page.commands(start, end)):
            bare.append(f"{title!r} (figures {figures[:3]}...)")
    assert not bare, f"{page.name}: sections with a table of figures and no command: {bare}"


def headline_bullets() -> list[str]:
    """The README's headline figures: the bullets of its Figures section, each joined into one line."""
    readme = Page.read(README)
    sections = [(start, end) for title, start, end in readme.sections() if title.lower().endswith("figures")]
    assert sections, "README.md has no Figures section"
    start, end = sections[0]
    bullets: list[str] = []
    for line in readme.prose[start + 1 : end]:
        if line.lstrip().startswith("- "):
            bullets.append(line.strip()[2:])
        elif bullets and line.startswith("  ") and line.strip():
            bullets[-1] += " " + line.strip()
    assert bullets, "README.md's Figures section lists no figure"
    return bullets


@pytest.mark.parametrize("bullet", headline_bullets(), ids=lambda b: b[:40])
def test_headline_figures_come_from_the_page_they_link(bullet: str) -> None:
    """Each headline figure links the docs page with its table, names its command, and is on that page."""
    links = [m.group(2) for m in LINK.finditer(CODE_SPAN.sub("", bullet)) if m.group(2).startswith("docs/")]
    assert links, f"no link into docs/: {bullet}"
    commands = [m.group(2) for m in CODE_SPAN.finditer(bullet)]
    assert any(is_command(c) for c in commands), f"no command: {bullet}"
    page = (ROOT / links[0].split("#")[0]).read_text(encoding="utf-8")
    text = LINK.sub(r"\1", CODE_SPAN.sub("", bullet))
    missing = [n for n in NUMBER.findall(text) if n not in page]
    assert not missing, f"{links[0]} does not hold {missing}: {bullet}"
