"""The command line: fast help, one-line errors, no tracebacks."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from rlx.cli import app

runner = CliRunner()


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.startswith("rlx ")


def test_schema_is_json_schema_with_descriptions():
    result = runner.invoke(app, ["schema"])
    assert result.exit_code == 0
    schema = json.loads(result.output)
    assert schema["title"] == "Recipe"
    assert "resources" in schema["properties"]
    resources = schema["$defs"]["Resources"]["properties"]
    assert all(field.get("description") for field in resources.values())
    assert schema["additionalProperties"] is False


def test_every_field_has_a_description():
    from pydantic import BaseModel

    from rlx.recipe import model

    for obj in vars(model).values():
        if isinstance(obj, type) and issubclass(obj, BaseModel) and obj is not model.StrictModel:
            for name, field in obj.model_fields.items():
                assert field.description, f"{obj.__name__}.{name} has no description"


def test_render_missing_file_is_one_line(tmp_path):
    result = runner.invoke(app, ["render", str(tmp_path / "nope.yaml"), "-b", "sky"])
    assert result.exit_code == 1
    assert "no such file" in result.output
    assert "Traceback" not in result.output


def test_render_schema_error_lists_findings(write_recipe):
    path = write_recipe("name: job\nresources:\n  nodes: many\n")
    result = runner.invoke(app, ["render", str(path), "-b", "dstack"])
    assert result.exit_code == 1
    assert f"{path}:3: error: resources.nodes:" in result.output
    assert "Traceback" not in result.output


def test_node_without_recipe_is_one_line(monkeypatch):
    monkeypatch.delenv("RLX_RECIPE_JSON", raising=False)
    result = runner.invoke(app, ["node", "--backend", "local"])
    assert result.exit_code == 1
    assert "no recipe" in result.output


def test_node_rejects_a_broken_recipe_env(monkeypatch):
    monkeypatch.setenv("RLX_RECIPE_JSON", '{"name": 3}')
    result = runner.invoke(app, ["node", "--backend", "local"])
    assert result.exit_code == 1
    assert "RLX_RECIPE_JSON does not hold a valid recipe" in result.output


def test_node_outside_a_sky_job(monkeypatch, write_recipe):
    for name in ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_NODES"):
        monkeypatch.delenv(name, raising=False)
    path = write_recipe("name: job\ncommand: [echo hi]\nray: {auth: none}\n")
    result = runner.invoke(app, ["node", "--backend", "sky", "--recipe", str(path)])
    assert result.exit_code == 1
    assert "SKYPILOT_NODE_IPS is not set" in result.output
