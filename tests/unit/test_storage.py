"""The URL grammar of a recipe's path fields: a store rlx writes to, or one clear line, never a
local folder named after a scheme."""

from __future__ import annotations

import pytest

from rlx.errors import RlxError
from rlx.storage import (
    check_url,
    is_store_url,
    is_url,
    location,
    missing_extra,
    storage_options,
    url_problem,
)


@pytest.mark.parametrize(
    "url", ["s3://b/p", "gs://b", "gcs://b/p", "az://c/p", "abfs://c/p", "abfss://c/p"]
)
def test_store_urls_are_accepted(url: str) -> None:
    assert is_store_url(url) and url_problem(url) is None


@pytest.mark.parametrize(
    "value,piece",
    [
        ("s3:/bucket/ckpt", "with a slash missing"),
        ("gs:bucket", "with a slash missing"),
        ("ftp://host/runs", "rlx cannot store to"),
        ("r2://bucket", "AWS_ENDPOINT_URL"),
        ("s3:///prefix", "names no bucket"),
    ],
)
def test_anything_else_written_as_a_url_is_refused(value: str, piece: str) -> None:
    problem = url_problem(value)
    assert problem is not None and piece in problem
    with pytest.raises(RlxError, match=r"trainer\.checkpoint\.dir") as info:
        check_url(value, "checkpoint.dir")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("path", ["runs", "./runs", "/shared/ckpt", "~/x", "Qwen/Qwen2.5-7B"])
def test_paths_and_hub_ids_are_not_urls(path: str) -> None:
    assert not is_url(path) and url_problem(path) is None


def test_a_missing_library_is_one_line_naming_the_extra(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gcsfs" else real(name, *a)
    )
    assert missing_extra("gs://bucket/x") == "gs:// needs gcsfs: pip install 'rlx[gcs]'"
    with pytest.raises(RlxError, match=r"pip install 'rlx\[gcs\]'"):
        location("gs://bucket/x", "checkpoint")


def test_endpoint_comes_from_the_environment_and_credentials_never_do() -> None:
    env = {
        "AWS_ENDPOINT_URL": "http://minio:9000",
        "AWS_ACCESS_KEY_ID": "id",
        "AWS_SECRET_ACCESS_KEY": "secret",
    }
    assert storage_options("s3://b/p", env) == {"endpoint_url": "http://minio:9000"}
    env["AWS_ENDPOINT_URL_S3"] = "http://r2"
    assert storage_options("s3://b/p", env) == {"endpoint_url": "http://r2"}
    assert storage_options("gs://b/p", env) == {}


@pytest.mark.parametrize(
    "field,value",
    [
        ("checkpoint", {"dir": "s3:/bucket/ckpt"}),
        ("logging", {"dir": "ftp://host/runs"}),
        ("model", {"path": "gs:bucket/model"}),
    ],
)
def test_start_up_refuses_the_url_before_anything_is_written(tmp_path, field, value) -> None:
    from rlx.trainer.resolve import run_paths
    from tests.support.recipes import make_recipe

    recipe = make_recipe(tmp_path, **{field: value})
    assert recipe.trainer is not None
    with pytest.raises(RlxError, match=rf"trainer\.{field}\.") as info:
        run_paths(recipe.name, recipe.trainer, {})
    assert "\n" not in str(info.value)
    assert not any(tmp_path.rglob("s3:*")) and not any(tmp_path.rglob("gs:*"))
