"""The benchmarks' writer of docs/benchmarks.md keeps what was written by hand after a section's generated part."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from benchlib import GENERATED_END, replace_section  # noqa: E402

pytestmark = pytest.mark.timeout(30)

HEADING = "## All-reduce (scripts/bench_allreduce.py)"


def test_a_rerun_replaces_its_output_and_keeps_the_notes_after_the_marker(tmp_path):
    md = tmp_path / "benchmarks.md"
    md.write_text(f"# Benchmarks\n\n{HEADING}\n\nold table\n\n{GENERATED_END}\n\n### A note by hand, 2026-11-27\n\n"
                  "measured by hand\n\n## Next section\n\nuntouched\n")
    replace_section(str(md), HEADING, f"{HEADING}\n\nnew table\n")
    text = md.read_text()
    assert "old table" not in text and "new table" in text and text.count(GENERATED_END) == 1
    assert text.index("new table") < text.index(GENERATED_END) < text.index("### A note by hand") < text.index("measured by hand")
    assert text.endswith("## Next section\n\nuntouched\n")


def test_a_section_without_the_marker_is_replaced_to_the_next_heading_and_a_new_one_appended(tmp_path):
    md = tmp_path / "benchmarks.md"
    md.write_text(f"# Benchmarks\n\n{HEADING}\n\nold\n\n## Next\n\nrest\n")
    replace_section(str(md), HEADING, f"{HEADING}\n\nnew\n")
    assert md.read_text() == f"# Benchmarks\n\n{HEADING}\n\nnew\n\n{GENERATED_END}\n\n## Next\n\nrest\n"
    replace_section(str(md), "## Other", "## Other\n\nrows\n")
    assert md.read_text().endswith(f"rest\n\n## Other\n\nrows\n\n{GENERATED_END}\n")
