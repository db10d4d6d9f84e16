"""The docs: the configuration reference is the schema's, as committed."""

from scripts.config_reference import OUTPUT, render


def test_the_config_reference_is_the_schemas_every_key_described():
    """`render` refuses a field without a description; the committed file is what it writes now."""
    assert OUTPUT.read_text() == render(), (
        "docs/reference/config.md is stale: python scripts/config_reference.py"
    )
