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


def test_readme_security_section_states_the_trust_model():
    from shared.queue import JOB_FUNC, RQ_CLI_FLAGS

    text = README.read_text()
    section = text[text.index("## Security") :]
    section = section[: section.index("\n## ", 1)]
    for needed in (
        "REDIS_PASSWORD",  # who can enqueue
        JOB_FUNC,  # what a worker runs
        "rq worker",  # what never to run
        RQ_CLI_FLAGS.split()[-1],  # the serializer to use instead
        "Docker socket",
        ".env",
        "VLLM_API_KEY",
        "HF_TOKEN",
        "target.revision",
    ):
        assert needed in section, needed
