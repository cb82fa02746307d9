"""Every figure the guidance quotes comes from a file a benchmark wrote.

README's "Which to pick" and docs/staleness.md's "What to turn on" are read block by block (a list item, a table
row, a paragraph). Each decimal figure in a block (code spans, link targets and thresholds written "≥ x" / "≤ x"
left out) must appear, sign included, in a rendered results file (``results.md``, ``time_to_reward.md``) under the
results folder of a page the block links to: ``docs/rlvr_grid.md`` -> ``docs/rlvr_grid/**``. Both ends of a range
"a–b" must come from one file. Integers (queue depths, seed counts, flags' values) are settings, not checked."""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDANCE = [("README.md", "## Which to pick"), (os.path.join("docs", "staleness.md"), "## What to turn on")]
RENDERED = (
    "results.md",
    "time_to_reward.md",
)  # the files the benchmarks write (benchmarks/rlvr_grid.py, staleness.py)
NUMBER = r"(?<![\w.])[−-]?\d+\.\d+(?![\w.]*\d)(?!e[−+-]?\d)"  # not the mantissa of 1.2e-09
RANGE = re.compile(rf"({NUMBER})–({NUMBER})")


def section(path: str, heading: str) -> str:
    lines = open(os.path.join(REPO, path), encoding="utf-8").read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start:end])


def blocks(text: str):
    """List items (with their indented continuation lines), table rows and paragraphs."""
    out, current = [], []
    for line in text.splitlines():
        starts = line.startswith(("- ", "|", "#")) or not line.strip()
        if starts and current:
            out.append("\n".join(current))
            current = []
        if line.strip():
            current.append(line)
    return out + (["\n".join(current)] if current else [])


def _norm(s: str) -> str:
    return s.replace("-", "−")


def figures(block: str):
    """(figures, ranges) of a block: decimals as written (sign normalized to −), and (low, high) pairs."""
    text = re.sub(r"`[^`]*`", " ", block)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = re.sub(rf"[≥≤]\s*{NUMBER}", " ", text)
    return [_norm(f) for f in re.findall(NUMBER, text)], [(_norm(a), _norm(b)) for a, b in RANGE.findall(text)]


def source_files(block: str, root: str = REPO):
    """The rendered results files under the results folder of every page the block links to."""
    files = []
    for target in re.findall(r"\]\(([^)#\s]+\.md)", block):
        folder = os.path.join(root, "docs", os.path.splitext(os.path.basename(target))[0])
        for root, _, names in os.walk(folder):
            files += [os.path.join(root, n) for n in sorted(names) if n in RENDERED]
    return files


def untraced(block: str, root: str = REPO):
    """The block's figures (and ranges) that no rendered file of its sources holds; [] when all are traced."""
    found, ranges = figures(block)
    if not found:
        return []
    read = lambda p: open(p, encoding="utf-8").read()  # noqa: E731
    tokens = [set(_norm(t) for t in re.findall(NUMBER, read(p))) for p in source_files(block, root)]
    if not tokens:
        return ["(figures, but no linked page with a results folder)"]
    missing = [f for f in found if not any(f in t for t in tokens)]
    missing += [f"{a}–{b}" for a, b in ranges if not any(a in t and b in t for t in tokens)]
    return missing


@pytest.mark.parametrize("path,heading", GUIDANCE, ids=["README", "staleness"])
def test_every_figure_in_the_guidance_is_in_a_results_file_a_benchmark_wrote(path, heading):
    text = section(path, heading)
    checked = [b for b in blocks(text) if figures(b)[0]]
    assert checked, f"no figures found in {path} {heading!r}: the section moved?"
    problems = {b.splitlines()[0][:100]: m for b in checked if (m := untraced(b))}
    assert not problems, (
        f"{path} {heading!r}: figures not in any results file of the pages each block links: {problems}"
    )


def test_the_check_finds_a_figure_no_results_file_holds():
    # the five-seed grid's async steps were 1.33-1.90x sync's (rendered in docs/rlvr_grid/results.md); 1.2-1.8x is not
    bad = "- every async step was 1.2–1.8× slower ([rlvr_grid.md](docs/rlvr_grid.md))"
    assert untraced(bad) == ["1.2", "1.8", "1.2–1.8"]
    good = "- every async step was 1.33–1.90× slower ([rlvr_grid.md](docs/rlvr_grid.md))"
    assert untraced(good) == []
    # a figure with no linked source, and the goal's threshold (not a result)
    assert untraced("- it was 0.97× as good") == ["(figures, but no linked page with a results folder)"]
    assert figures("reaches ≥ 0.9× of sync's, at −1.10× (−1.33 to −0.86)") == (["−1.10", "−1.33", "−0.86"], [])
    assert figures("PPO KL 1.2e-09, then 1.25") == (["1.25"], [])  # a logged 1.2e-09 traces no figure 1.2


def test_both_ends_of_a_range_must_come_from_one_file(tmp_path):
    # two results files, each holding one end: each figure is traced, the range is not
    for name, row in (("a", "| x | 0.63 |"), ("b", "| y | 1.08 |")):
        os.makedirs(tmp_path / "docs" / "rlvr_grid" / name)
        (tmp_path / "docs" / "rlvr_grid" / name / "results.md").write_text(row)
    (tmp_path / "docs" / "rlvr_grid" / "notes.md").write_text("0.5")  # not a rendered file: not a source
    assert untraced("- 0.63–1.08 ([g](rlvr_grid.md))", root=str(tmp_path)) == ["0.63–1.08"]
    assert untraced("- 0.63 and 1.08 ([g](rlvr_grid.md))", root=str(tmp_path)) == []
    assert untraced("- 0.5 ([g](rlvr_grid.md))", root=str(tmp_path)) == ["0.5"]
