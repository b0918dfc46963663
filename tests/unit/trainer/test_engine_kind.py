"""The engine's kind is decided in rollout/ (choose_engine, and the one place that builds an
engine by its name); the rest of the trainer holds a RolloutEngine and calls it, never asking
which kind it holds. Read from the source, like test_layers.py."""

from __future__ import annotations

import re
from pathlib import Path

TRAINER = Path(__file__).resolve().parents[3] / "rlx" / "trainer"

# A comparison with an engine's name, a check of an engine's class, or an engine's attribute
# read by name where one engine has it.
SWITCH = re.compile(
    r"isinstance\([^)]*(HF|VLLM)Engine"
    r"|getattr\([^)]*decode_note|\.decode_note"
    r"|(==|!=)\s*[\"'](vllm|hf)[\"']|[\"'](vllm|hf)[\"']\s*(==|!=)"
    r"|engine_kind\s*(==|!=)|\.engine\s*(==|!=)"
)


def engine_kind_switches(root: Path = TRAINER) -> list[str]:
    """Each line of the trainer outside rollout/ that switches on the engine's kind."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "rollout":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if SWITCH.search(line):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_no_caller_outside_rollout_asks_which_engine_it_holds():
    assert engine_kind_switches() == [], "ask the engine (rollout/base.py), not its kind"


def test_a_switch_is_found_when_there_is_one(tmp_path):
    (tmp_path / "rollout").mkdir()
    (tmp_path / "rollout" / "x.py").write_text('if kind == "vllm":\n    pass\n')
    (tmp_path / "actor.py").write_text(
        'if spec.engine_kind == "vllm":\n    pass\nnote = getattr(engine, "decode_note", None)\n'
    )
    assert [line.split(":")[1] for line in engine_kind_switches(tmp_path)] == ["1", "3"]
