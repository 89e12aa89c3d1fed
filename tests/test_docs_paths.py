"""Every repository path that README.md, docs/*.md, tests/README.md and requirements.txt name exists
(CHANGELOG.md is history: it names paths as they were).

A reference is a repository path when it is a relative markdown link, or when a word of inline code, of a code
block or of a requirements.txt comment holds a ``/`` and its first part names an entry of the repository's root
(``tests/...``, ``configs/...``), of the package (a module or a subpackage: ``ops/dispatch.py`` is
``polaformer/ops/dispatch.py``, ``models/`` is ``polaformer/models/``) or, in docs/, of docs/ (``figures/...``).
Words whose first part is none of these (``runs/digits``, ``DIR/val``, ``fla/ops/...``) name outputs,
placeholders or other repositories and are not checked. Within a checked path,
``<name>`` and ALL-CAPS words (``configs/lra/TASK.yaml``) are placeholders and ``{a,b}`` alternatives: it must then
match at least one file. ``path::test`` and ``path:name`` must also define that test or name, and a link's
``#anchor`` a heading of the linked file.
"""
import itertools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "polaformer"
DOCS = REPO / "docs"
DOC_FILES = [REPO / "README.md", *sorted(DOCS.glob("*.md")), REPO / "tests" / "README.md"]

# Folders a checkout gains by running things (.gitignore): docs show paths inside them as what a run writes.
OUTPUT_FOLDERS = {"runs", "output", "build", "dist"}
# Paths of other repositories that share a first part with ours, each with where the docs cite it.
FOREIGN = {
    "tests/test_models.py": "timm's own model test-suite, run against our models (docs/timm.md)",
    "data/build.py": "the official Swin/PolaFormer data module, whose loader ours follows (docs/data.md)",
    "configs/PolaPP/polapp_b*.py": "the official PolaFormer++ segmentation configs (docs/dense.md)",
}


def _entries(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.name != "__pycache__" and not p.name.startswith(".")}


ROOTS = [(REPO, (_entries(REPO) | {".ci"}) - OUTPUT_FOLDERS), (PACKAGE, _entries(PACKAGE))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    return {slug(h) for h in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M)}


def words(text: str, markdown: bool) -> list[str]:
    """The words that hold a ``/``: of code blocks and inline code in markdown, of comments in requirements.txt."""
    if markdown:
        blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        spans = blocks + re.findall(r"`([^`\n]+)`", prose)
    else:
        spans = [line for line in text.splitlines() if line.lstrip().startswith("#")]
    found = []
    for span in spans:
        for word in re.split(r"[\s'\"=();\[\]]+", span):
            word = word.rstrip(".:,")
            if "/" in word and "://" not in word and not word.startswith(("/", "~", "$", "-")):
                found.append(word)
    return found


def links(markdown: str) -> list[str]:
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose)
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


def _expand(path: str) -> list[str]:
    """``{a,b}`` alternatives as separate paths."""
    parts = re.split(r"\{([^{}]*,[^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _matches(base: Path, path: str) -> bool:
    for candidate in _expand(path):
        if (base / candidate).exists():
            continue
        pattern = re.sub(r"<[^<>]+>|\$\{?\w+\}?", "*", candidate)
        pattern = re.sub(r"(?<![A-Za-z0-9_])[A-Z][A-Z0-9_]*[A-Z](?![a-z0-9])", "*", pattern)
        if not re.search(r"[*?]", pattern) or not any(base.glob(pattern.rstrip("/"))):
            return False
    return True


def _defines(file: Path, name: str) -> bool:
    return bool(re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b|^{name}\s*[:=]", file.read_text(), re.M))


def problems_of_word(word: str, roots) -> str | None:
    """None where ``word`` is no repository path or names one that exists, else what is wrong with it."""
    if word in FOREIGN:
        return None
    path, _, test = word.partition("::")
    path, _, name = path.partition(":")
    first = path.split("/")[0]
    for base, names in roots:
        if first in names:
            break
    else:
        return None
    if base == PACKAGE and not (re.search(r"\.\w+$", path) or path == f"{first}/"):
        return None  # data/ and analysis/ are also what users call their data and output folders (data/listops)
    if not _matches(base, path):
        return f"{word}: no such path in {'the repository root' if base == REPO else base.relative_to(REPO)}"
    symbol = test or name
    if symbol and not _defines(base / path, re.escape(symbol.split("[")[0])):
        return f"{word}: {path} defines no {symbol}"
    return None


def problems_of_link(target: str, source: Path) -> str | None:
    path, _, anchor = target.partition("#")
    file = (source.parent / path).resolve() if path else source
    if not file.exists():
        return f"({target}): no such file"
    if anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
        return f"({target}): {file.name} has no heading #{anchor}"
    return None


def problems(source: Path, text: str) -> list[str]:
    markdown = source.suffix == ".md"
    roots = ROOTS + ([(DOCS, _entries(DOCS))] if source.parent == DOCS else [])
    found = [problems_of_word(word, roots) for word in words(text, markdown)]
    if markdown:
        found += [problems_of_link(target, source) for target in links(text)]
    return sorted({p for p in found if p})


@pytest.mark.parametrize("source", [*DOC_FILES, REPO / "requirements.txt"], ids=lambda p: str(p.relative_to(REPO)))
def test_every_repository_path_named_exists(source):
    assert problems(source, source.read_text()) == []


def test_the_check_finds_stale_paths_tests_names_and_anchors():
    text = """See [the guide](docs/no_such_guide.md), [causal](docs/causal.md#no-such-heading) and
[errors](docs/errors.md). The kernels live in `polaformer/csrc`; `ops/no_such_op.py` and
`tests/test_readme.py::test_gone` are gone; `configs/lra/TASK.yaml` and `tests/{cli,engine}/` are there,
`runs/digits` is an output, `configs/gone/TASK.yaml` matches nothing.

```bash
python scripts/no_such_script.py --config configs/lra/text.yaml --out runs/x
```
"""
    assert problems(REPO / "README.md", text) == [
        "(docs/causal.md#no-such-heading): causal.md has no heading #no-such-heading",
        "(docs/no_such_guide.md): no such file",
        "configs/gone/TASK.yaml: no such path in the repository root",
        "ops/no_such_op.py: no such path in polaformer",
        "polaformer/csrc: no such path in the repository root",
        "scripts/no_such_script.py: no such path in the repository root",
        "tests/test_readme.py::test_gone: tests/test_readme.py defines no test_gone",
    ]
