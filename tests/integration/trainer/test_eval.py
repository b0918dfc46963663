"""`rlx eval` on a tiny model with the HF engine, from a training checkpoint (DCP, no export
by the user) and from its export: the same samples, and the printed pass@k is what the
written samples give when counted afresh."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tests.support.cli import invoke
from tests.unit.trainer.tasks.test_passk import recompute_from_samples


def _save_checkpoint(model_dir: Path, root: Path) -> Path:
    """The tiny model saved as a run's step-1 checkpoint, by the save every training rank
    runs (here one rank, in this process)."""
    from transformers import AutoModelForCausalLM

    from rlx.trainer.checkpoint.protocol import SaveRequest
    from rlx.trainer.checkpoint.store import CheckpointManager

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    manager = CheckpointManager(root, "run", 1)
    request = SaveRequest(str(manager.begin(1)), manager, 1, {"trainer_state": {"step": 1}}, [{}])
    finished: Any = manager.save_rank(
        request,
        0,
        1,
        learner_state=lambda: {"policy": model.state_dict()},
        learner_parts=dict,
        dtype="float32",
        model_folder=model_dir,
    )
    return Path(finished.result().path)


def _printed(output: str) -> dict[str, float]:
    """The table's header and its one data row, as numbers."""
    rows = [line for line in output.splitlines() if "│" in line or "┃" in line]
    header = [cell.strip() for cell in rows[0].split("┃")[1:-1]]
    cells = [cell.strip() for cell in rows[1].split("│")[1:-1]]
    return {h: float(c) for h, c in zip(header, cells, strict=True) if re.fullmatch(r"[\d.]+", c)}


def test_eval_from_a_checkpoint_and_its_export(tmp_path: Path, tiny_model_dir: Path) -> None:
    from rlx.trainer.checkpoint.export import export_checkpoint

    checkpoint = _save_checkpoint(tiny_model_dir, tmp_path / "ckpt")
    exported = export_checkpoint(checkpoint, tmp_path / "exported").folder
    data = tmp_path / "prompts.jsonl"
    rows = [("Write digits.", "digits"), ("Write letters.", "letters")] * 3
    data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    common = ["--data", str(data), "--reward", "letters_or_digits", "--n", "4"]
    common += ["--max-new-tokens", "8", "--pass-threshold", "0.05", "--seed", "1"]
    printed = {}
    for name, target in (("dcp", checkpoint), ("export", exported)):
        out = tmp_path / name
        result = invoke(["eval", str(target), *common, "--out", str(out)], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        summary = json.loads((out / "summary.json").read_text())
        assert {"pass@1", "pass@2", "pass@4", "avg@4", "response_length"} <= set(summary)
        assert "maj@4" not in summary  # letters_or_digits compares no answers
        samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        assert len(samples) == 6 * 4
        assert {"prompt", "response", "reward", "correct", "extracted"} <= set(samples[0])
        recomputed = recompute_from_samples(out / "samples.jsonl")
        printed[name] = _printed(result.output)
        for key, value in recomputed.items():
            assert abs(printed[name][key] - value) < 1e-4, (key, printed[name][key], value)
            assert abs(summary[key] - value) < 1e-12
    assert printed["dcp"]["pass@4"] > 0  # something to compare: not all zero
    assert printed["dcp"] == printed["export"]  # the same weights, the same samples


FLAKY = """
def score(prompt, response, answer):
    if answer == "digits":
        raise ValueError("no verdict on digits")
    return 0.5
"""


def test_a_recipe_of_mixed_rewards_is_scored_as_its_validation_scores(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`rlx eval RECIPE` of a recipe with trainer.rewards: each sample's reward is the terms'
    weighted sum; a sample a weighted term failed on has none, is not correct, and the
    table's note counts it."""
    import yaml

    from rlx.trainer.tasks.synthetic import letters_or_digits_reward

    _save_checkpoint(tiny_model_dir, tmp_path / "ckpt")  # run "run", step 1
    data = tmp_path / "prompts.jsonl"
    rows = [("Write digits.", "digits"), ("Write letters.", "letters")] * 2
    data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    (tmp_path / "flaky.py").write_text(FLAKY)
    recipe = tmp_path / "run.yaml"
    trainer = {
        "model": {"path": str(tiny_model_dir), "dtype": "float32"},
        "data": {"train": str(data), "answer_key": "answer"},
        "rewards": [
            {"function": "letters_or_digits", "weight": 1.0},
            {"function": f"{tmp_path / 'flaky.py'}:score", "weight": 2.0},
        ],
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
        "logging": {"dir": str(tmp_path / "runs")},
    }
    recipe.write_text(yaml.safe_dump({"name": "run", "trainer": trainer}))
    out = tmp_path / "mixed"
    args = ["eval", str(recipe), "--n", "2", "--max-new-tokens", "8", "--out", str(out)]
    result = invoke([*args, "--pass-threshold", "0.5"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "note: prompts.jsonl: 4 of 8 samples have no reward (" in result.output
    assert "no verdict on digits" in result.output
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    for sample in samples:
        if sample["answer"] == "digits":
            assert sample["reward"] is None and sample["correct"] is False
        else:
            expected = (
                letters_or_digits_reward(sample["prompt"], sample["response"], "letters") + 1.0
            )
            assert abs(sample["reward"] - expected) < 1e-9, sample
            assert sample["correct"] is True  # 0.5 or more: flaky's 2 x 0.5 alone
