"""The README's coverage table is docs/coverage.md's, regenerated, never typed."""

from pathlib import Path

from paraxis_coverage.report import README_BEGIN, README_END, readme_table

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    block = readme.split(README_BEGIN, 1)[1].split(README_END, 1)[0].strip()
    assert block == readme_table((ROOT / "docs/coverage.md").read_text())
