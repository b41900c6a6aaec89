"""bench.plot draws the documents' figures from the reports docs/benchmarks.md names."""

import re
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from smfree_pg.bench import plot  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def documented_command() -> list[str]:
    """The reports of benchmarks.md's plot command, in its order."""
    text = (ROOT / "docs/benchmarks.md").read_text()
    command = re.search(r"python -m smfree_pg\.bench\.plot (.*?)\n```", text, re.DOTALL).group(1)
    return [word for word in command.replace("\\", " ").split() if word.endswith(".json")]


def test_the_documented_command_draws_every_figure_benchmarks_md_shows(tmp_path):
    reports = documented_command()
    assert reports
    plot.main(["--out", str(tmp_path), *(str(ROOT / report) for report in reports)])
    drawn = sorted(path.name for path in tmp_path.glob("*.png"))
    shown = sorted(set(re.findall(r"!\[[^]]*\]\(([\w-]+\.png)\)",
                                  (ROOT / "docs/benchmarks.md").read_text())))
    assert drawn == shown
    assert all((tmp_path / name).stat().st_size > 10_000 for name in drawn)


def test_a_report_of_another_schema_is_refused(tmp_path):
    other = tmp_path / "other.json"
    other.write_text('{"schema": "something-else"}')
    with pytest.raises(SystemExit, match="is not a smfree-bench/1 report"):
        plot.main([str(other)])
