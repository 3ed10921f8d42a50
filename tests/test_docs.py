"""Docs stay in step with the code: the README's recipe reference names every field."""

from pathlib import Path

from tests.shared.test_recipe import all_field_paths

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_recipe_reference_names_every_field():
    text = README.read_text()
    start, end = text.index("<!-- recipe-reference -->"), text.index("<!-- /recipe-reference -->")
    ref = text[start:end]
    missing = [p for p in all_field_paths() if f"`{p}`" not in ref]
    assert missing == [], (
        f"README recipe reference lacks {missing}: run scripts/recipe_reference.py"
    )


def test_readme_opens_with_the_two_commands():
    head = README.read_text()[:2500]
    assert "scripts/demo" in head and "scripts/test" in head


def test_readme_stage_table_matches_the_declarations():
    """The Architecture table names every declared stage with the queue it really uses."""
    from shared.stage import load_stages

    text = README.read_text()
    section = text[text.index("## Architecture") :]
    section = section[: section.index("\n## ", 1)]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] not in ("stage", "---"):
            table[cells[0]] = cells[1]
    assert table == {name: st.queue for name, st in load_stages().items()}
