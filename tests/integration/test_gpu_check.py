"""bench/gpu_check.py in its CPU mode at tiny shapes: every part runs the trainer's own classes
(so the script a GPU machine runs cannot rot), a part whose prerequisite is missing is
skipped in one line while the others run, and the FLOPs it divides by are the documented
count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.support.bench import load_bench

SCRIPT = REPO / "bench" / "gpu_check.py"


def run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[str, dict]:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    return proc.stdout, json.loads((out / "gpu_check-cpu-tiny.json").read_text())


def test_every_part_runs_the_trainer_on_cpu(tmp_path: Path) -> None:
    gpu_check = load_bench("gpu_check")
    stdout, results = run(tmp_path)
    for part in gpu_check.PARTS:
        assert results[part]["status"] == "ran", (part, results[part])
        assert any(line.startswith(part) for line in stdout.splitlines()), part
    for case in gpu_check.CASES:
        learner = results[case.part]
        assert learner["losses_finite"] and learner["packing"], learner
        assert learner["tokens_per_s"] > 0 and learner["model_tflops"] > 0
        assert learner["plan_gib"] > 0  # planned for an H100 though run on the CPU
    assert results["fsdp-dcp"]["equal"], results["fsdp-dcp"]
    for dtype in ("bfloat16", "float32"):
        assert results["packing"][dtype]["within"], results["packing"]
    decode = results["decode"]["float32"]
    assert decode["decode_step"] and decode["rows_identical"] == "8/8", decode
    # a bf16 engine against the float32 learner disagrees, a little, on every run
    mismatch = results["mismatch"]["learner float32"]
    assert 0 < mismatch["mismatch/kl"] < 1e-2, mismatch
    assert mismatch["mismatch/max_abs_logprob_diff"] > 0


def test_a_missing_prerequisite_skips_its_part_only(tmp_path: Path) -> None:
    blocked = tmp_path / "blocked" / "peft"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('peft blocked by the test')\n")
    pythonpath = os.pathsep.join([str(blocked.parent), os.environ.get("PYTHONPATH", "")])
    stdout, results = run(tmp_path, "--parts", "learner-7b-lora", env={"PYTHONPATH": pythonpath})
    assert results["learner-7b-lora"] == {
        "status": "skipped",
        "why": "peft is not installed",
        "seconds": results["learner-7b-lora"]["seconds"],
    }
    assert [line for line in stdout.splitlines() if "skipped" in line] == [
        "[gpu-check] learner-7b-lora: skipped: peft is not installed",
        "learner-7b-lora  skipped: peft is not installed",
    ]
    assert results["machine"]["status"] == "ran"  # the part that always runs went on


def test_unknown_part_is_one_line_and_exit_1(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--parts", "machine,learner-3b"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines() == [
        "gpu_check: unknown part 'learner-3b'; use some of "
        + ", ".join(load_bench("gpu_check").PARTS)
    ]


@pytest.mark.parametrize("shared", [False, True])
def test_step_flops_is_the_documented_count(shared: bool) -> None:
    """Two sequences, prompt 3 tokens, responses 2 and 1; hidden 4, 1 layer, 10 matrix weights.
    Counted by hand: a shared prompt once, each response token attending to the prompt and
    the response up to itself."""
    from rlx.trainer.batch import RolloutBatch, pack_rollout

    gpu_check = load_bench("gpu_check")
    prompt = [5, 6, 7]
    rollout = RolloutBatch(
        prompt_ids=[prompt, prompt if shared else [5, 6, 8]],
        response_ids=torch.tensor([[9, 9], [9, 0]]),
        response_mask=torch.tensor([[True, True], [True, False]]),
        logprobs=torch.zeros(2, 2),
        finished=torch.tensor([True, True]),
        n=2 if shared else 1,
        pad_token_id=0,
        weight_version=0,
    )
    batch = pack_rollout(rollout)

    class Config:
        num_hidden_layers, hidden_size = 1, 4

    prompts = 1 if shared else 2
    tokens = 3 * prompts + 3
    keys = 6 * prompts + (2 * 3 + 3) + (1 * 3 + 1)  # prompt 1+2+3; response 4+5; 4
    assert gpu_check.distinct_tokens(batch) == tokens
    linear, attention = 2 * 10 * tokens, 4 * 1 * 4 * keys
    full = 1 * (linear + attention) + (3 * linear + 3 * attention)  # one ref pass, fwd+bwd
    frozen = 1 * (linear + attention) + (2 * linear + 3 * attention)  # LoRA: input grads only
    assert gpu_check.step_flops(batch, Config, 10, passes=1, trained=4) == full
    assert gpu_check.step_flops(batch, Config, 10, passes=1, trained=2) == frozen


def test_a_part_past_its_bound_is_one_line_and_the_next_part_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import threading
    import time

    gpu_check = load_bench("gpu_check")
    release = threading.Event()  # the stuck part ends with the test
    monkeypatch.setitem(gpu_check.PART_FUNCTIONS, "stuck", lambda check: release.wait(60) and {})
    monkeypatch.setitem(gpu_check.PART_FUNCTIONS, "quick", lambda check: {"answer": 42})
    monkeypatch.setitem(gpu_check.PART_BOUND_S, "tiny", 0.5)
    check = gpu_check.Check(
        device=torch.device("cpu"),
        tiny=True,
        scratch=tmp_path,
        json_path=tmp_path / "out.json",
        steps=1,
        results={},
    )
    started = time.monotonic()
    gpu_check.run_part(check, "stuck")
    gpu_check.run_part(check, "quick")
    release.set()
    assert time.monotonic() - started < 10
    assert check.results["stuck"]["status"] == "timed out"
    assert check.results["quick"]["status"] == "ran" and check.results["quick"]["answer"] == 42
    assert json.loads((tmp_path / "out.json").read_text())["stuck"]["status"] == "timed out"
    assert "[gpu-check] stuck: timed out: still running after 0 s" in capsys.readouterr().out
