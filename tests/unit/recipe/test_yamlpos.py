import pytest

from rlx.recipe.yamlpos import YamlError, load_yaml


def test_yaml_1_2_scalars_keep_strings_strings():
    data, _ = load_yaml("a: no\nb: on\nc: 1:00:00\nd: 0x10\ne: 1e3\nf: '5'\ng: ~\nh: True\n")
    assert data == {
        "a": "no",
        "b": "on",
        "c": "1:00:00",
        "d": 16,
        "e": 1000.0,
        "f": "5",
        "g": None,
        "h": True,
    }


def test_positions_of_nested_keys_and_list_items():
    text = "name: x\nresources:\n  nodes: 2\nvolumes:\n  - path: /a\n  - path: /b\n    name: v\n"
    _, pos = load_yaml(text)
    assert pos.line_of(("resources", "nodes")) == 3
    assert pos.line_of(("volumes", 1, "name")) == 7
    # a field that is not written points at the nearest written parent
    assert pos.line_of(("resources", "accelerators")) == 2


def test_duplicate_keys_are_errors_with_both_lines():
    with pytest.raises(YamlError) as exc:
        load_yaml("name: a\nsteps: 1\nname: b\n")
    assert exc.value.line == 3
    assert "first written on line 1" in str(exc.value)


@pytest.mark.parametrize(
    "text,line", [("a: [1\n", 2), ("a: b\n  c: d\n", 2), ("a: !!python/name:os.system x\n", 1)]
)
def test_invalid_yaml_reports_a_line(text, line):
    with pytest.raises(YamlError) as exc:
        load_yaml(text)
    assert exc.value.line == line


def test_tagged_collections_are_refused():
    with pytest.raises(YamlError, match="unsupported YAML tag"):
        load_yaml("a: !!python/object:os.system {x: 1}\n")
