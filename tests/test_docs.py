"""The documents against what they cite: every benchmark report a document names exists and
records how it was made, every report is cited, every link into a document lands on a heading,
and the settings' defaults in README.md and docs/design.md are the code's."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BENCH = DOCS / "bench"
DOCUMENTS = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def links(document: Path) -> list[str]:
    return LINK.findall(document.read_text())


def target(document: Path, link: str) -> tuple[Path, str]:
    path, _, anchor = link.partition("#")
    return ((document.parent / path).resolve() if path else document), anchor


def cited_reports() -> dict[Path, list[str]]:
    """Each file under docs/bench/ a document links to, with the documents that link to it."""
    cited: dict[Path, list[str]] = {}
    for document in DOCUMENTS:
        for link in links(document):
            path, _ = target(document, link)
            if path.parent == BENCH:
                cited.setdefault(path, []).append(document.name)
    return cited


def provenance_fields() -> tuple[str, ...]:
    """FIELDS of smfree_pg/bench/provenance.py, read without importing torch."""
    source = (ROOT / "python/smfree_pg/bench/provenance.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["FIELDS"]:
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("provenance.py defines no FIELDS")


def provenance_of(report: Path) -> dict:
    """A JSON report's "provenance"; a text report's is in NAME.provenance.json beside it."""
    if report.suffix == ".json":
        return json.loads(report.read_text()).get("provenance")
    beside = report.with_name(report.stem + ".provenance.json")
    assert beside.exists(), f"{report.name} has no {beside.name}"
    record = json.loads(beside.read_text())
    assert record["report"] == report.name, f"{beside.name} names {record['report']}"
    return record["provenance"]


def test_documents_cite_reports():
    assert len(cited_reports()) > 10


@pytest.mark.parametrize("report", sorted(cited_reports()), ids=lambda p: p.name)
def test_every_cited_report_exists_and_records_how_it_was_made(report: Path):
    assert report.exists(), f"{report.name}, cited by {cited_reports()[report]}, is missing"
    record = provenance_of(report)
    assert isinstance(record, dict), f"{report.name} has no provenance"
    absent = record.get("absent", {})
    for field in provenance_fields():
        if field in absent:
            assert absent[field].strip(), f"{report.name}: {field} absent without a reason"
            assert field not in record, f"{report.name}: {field} both given and absent"
        else:
            assert record.get(field) not in (None, ""), f"{report.name} lacks {field}"
    assert isinstance(record.get("settings", {}), dict)
    assert all(k.startswith("SMFREE_") for k in record.get("settings", {}))
    if "commit" in record:
        assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]), record["commit"]


def test_every_report_is_cited():
    cited = set(cited_reports())
    for path in sorted(BENCH.iterdir()):
        if path.name.endswith(".provenance.json"):
            report = path.with_name(path.name.removesuffix(".provenance.json") + ".txt")
            assert report in cited, f"{path.name} is beside no cited report"
        else:
            assert path in cited, f"docs/bench/{path.name} is cited by no document"


def anchors(document: Path) -> set[str]:
    """GitHub's anchors for a Markdown document's headings."""
    found = set()
    for line in document.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_links_land(document: Path):
    for link in links(document):
        if re.match(r"[a-z]+://", link):
            continue
        path, anchor = target(document, link)
        assert path.exists(), f"{document.name} links to {link}, which does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{document.name} links to {link}: no such heading"


# --- the settings' defaults ------------------------------------------------------------------

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "ms": 1000, "s": 1000 * 1000}


def code_defaults() -> dict[str, str | int]:
    """Each SMFREE_* setting's default as the C++ code has it."""
    # SMFREE_LOG_LEVEL is read in Log.cpp, the rest in Config.cpp.
    config = "".join((ROOT / "csrc/engine" / name).read_text()
                     for name in ("Config.cpp", "Log.cpp"))
    defaults: dict[str, str | int] = {}
    for name, value in re.findall(r'parse(?:NonNegative|Between)\("(SMFREE_\w+)",\s*([^,)]+)',
                                  config):
        defaults[name] = value.strip()
    # String settings: parseX(std::getenv("SMFREE_Y")) whose function falls back to "value".
    for function, name in re.findall(r'(parse\w+)\(std::getenv\("(SMFREE_\w+)"\)\)', config):
        body = config[config.index(f" {function}(const char* text)"):]
        defaults[name] = re.search(r'text \? text : "(\w+)"', body[:400]).group(1)
    # SMFREE_SPIN_US's fallback in Config.cpp is unused (read only when set): Spin's counts.
    spin = (ROOT / "csrc/engine/Spin.h").read_text()
    defaults["SMFREE_SPIN_US"] = re.search(r"kDefault\{(\d+)\}", spin).group(1)
    staging = re.search(r"const long staging = [^?]+\? ([^:]+) : (\w+);", config)
    defaults["SMFREE_STAGING_BYTES"] = staging.group(2)
    collectives = (ROOT / "csrc/backend/Collectives.cpp").read_text()
    defaults["SMFREE_COLLECTIVES"] = re.search(r'kDefaultCollectives = "(\w+)"',
                                               collectives).group(1)
    defaults["SMFREE_COLLECTIVE_MIN_BYTES"] = re.search(
        r"kDefaultMinBytes = ([^;]+);", collectives).group(1)
    return {name: evaluate(value) for name, value in defaults.items()}


def evaluate(value: str) -> str | int:
    """A C++ default: a name, or an integer expression such as `16 << 20` or `1l << 30`."""
    if re.fullmatch(r"[a-z_]+", value):
        return value
    expression = re.sub(r"(\d+)[lL]+\b", r"\1", value)
    assert re.fullmatch(r"[\d\s<()*+]+", expression), value
    return int(eval(expression))  # noqa: S307 (digits and shifts only, checked above)


def stated(text: str, name: str) -> str | int:
    """A document's default ("16 MiB", "`peer_gpu`", "`10000`¹", "10 ms") in the code's units."""
    text = text.strip().strip("¹").strip().strip("`")
    number = re.fullmatch(r"(\d+)\s*(KiB|MiB|GiB|ms|s)?", text)
    if not number:
        return text
    value, unit = int(number.group(1)), number.group(2)
    if unit in ("ms", "s"):
        # Durations: the code's unit is the name's (_US or _MS).
        per = UNITS[unit] if name.endswith("_US") else UNITS[unit] // 1000
        return value * per
    return value * UNITS[unit] if unit else value


def readme_defaults() -> dict[str, str | int]:
    rows = re.findall(r"^\| `(SMFREE_\w+)` \| ([^|]+) \|", (ROOT / "README.md").read_text(),
                      re.MULTILINE)
    # "0 (16 MiB with `driver` copies)": the default, then the case that changes it.
    return {name: stated(value.split(" (")[0], name) for name, value in rows}


def design_defaults() -> dict[str, str | int]:
    text = (DOCS / "design.md").read_text()
    section = text[text.index("## Settings and UCX defaults"):]
    found = {}
    for names, value in re.findall(r"^- (`SMFREE_\w+`(?:, `[^`]+`, and `SMFREE_\w+`)?), ([^:]+):",
                                   section, re.MULTILINE):
        first = re.findall(r"`(SMFREE_\w+)`(?:, `([^`]+)`)?", names)
        for name, own in first:
            found[name] = stated(own if own else value.split(" (")[0], name)
    return found


def test_code_defaults_are_read():
    defaults = code_defaults()
    assert defaults["SMFREE_LOCAL_COPIES"] in ("driver", "peer_gpu", "host")
    assert isinstance(defaults["SMFREE_EAGER_BYTES"], int)
    assert len(defaults) >= 15, sorted(defaults)


@pytest.mark.parametrize("source", [readme_defaults, design_defaults], ids=["README", "design"])
def test_documented_defaults_are_the_code_s(source):
    code = code_defaults()
    documented = source()
    assert documented, f"{source.__name__} found no defaults"
    for name, value in documented.items():
        assert name in code, f"{name} is documented but the code reads no such setting"
        assert value == code[name], f"{name}: documented {value!r}, code {code[name]!r}"
    if source is readme_defaults:
        assert set(code) <= set(documented), f"README lacks {sorted(set(code) - set(documented))}"
