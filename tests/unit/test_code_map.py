"""The README's code map ("Where things are") is the package as it is: every wing (package) and
every module under src/distflow is in it, it names nothing that does not exist, and each wing's
line is the first paragraph of that wing's `__init__.py` docstring (docs_helpers.code_map).

When it fails after a module or a wing was added, moved or described anew:
`.venv/bin/python tests/support/docs_helpers.py code-map` rewrites the map in README.md.
"""

import ast

import pytest

from docs_helpers import PACKAGE, code_map, code_map_names, package_tree, readme_code_map

FIX = "rewrite it with `.venv/bin/python tests/support/docs_helpers.py code-map`"
TREE = package_tree()


def test_every_wing_is_in_the_readme_code_map_and_every_wing_there_exists():
    named = code_map_names(readme_code_map())
    missing = sorted(set(TREE) - set(named))
    gone = sorted(set(named) - set(TREE))
    assert not missing, f"wings missing from the README's code map: {missing}; {FIX}"
    assert not gone, f"the README's code map names wings that do not exist: {gone}; {FIX}"


@pytest.mark.parametrize("wing", sorted(TREE), ids=lambda w: w or "src/distflow/*.py")
def test_every_module_of_a_wing_is_in_the_code_map_and_nothing_else(wing):
    named = code_map_names(readme_code_map()).get(wing, [])
    missing = sorted(set(TREE[wing]) - set(named))
    gone = sorted(set(named) - set(TREE[wing]))
    assert not missing, f"modules of src/distflow/{wing} missing from the README's code map: {missing}; {FIX}"
    assert not gone, f"the README's code map names modules of src/distflow/{wing} that do not exist: {gone}; {FIX}"


def test_readme_code_map_is_the_generated_one():
    assert code_map() in readme_code_map(), f"the README's code map differs from the wings' docstrings; {FIX}"


@pytest.mark.parametrize("wing", sorted(w for w in TREE if w))
def test_every_wing_says_what_it_is(wing):
    doc = ast.get_docstring(ast.parse((PACKAGE / wing / "__init__.py").read_text())) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    assert len(paragraph.split()) >= 8, f"src/distflow/{wing}__init__.py needs a docstring that says what the wing is"


def test_code_map_names_reads_back_what_code_map_writes():
    assert code_map_names(code_map()) == TREE
