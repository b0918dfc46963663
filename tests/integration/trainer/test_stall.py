"""A run nobody watches that stalls stops by itself: a reward call that hangs at step 3, then
(the same run tried again) a rollout engine whose call never returns at step 3, each end
within stall_timeout + 30 s with one line naming the phase and who did not answer, exit 75.
The reward's stall saves step 2 (no cadence would have: checkpoint.every is 3), since the
training ranks still answer; the engine's, in the training ranks' own processes, keeps that
checkpoint intact; the third try resumes there and finishes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rlx.errors import TRY_AGAIN
from rlx.trainer.main import run_training
from rlx.trainer.stall import HANG_HOOK_ENV, Stalled
from tests.support.recipes import make_recipe

pytestmark = pytest.mark.timeout(300)

STALL_TIMEOUT = 10
PROMPTS, N = 2, 2

# Scores every response; once the marker beside it holds k, calls after the k-th sleep
# (a reward that hangs on some input).
REWARD = """
import time
from pathlib import Path

MARKER = Path(__file__).with_name("reward-hangs-after")
calls = 0


def reward(prompt, response, answer):
    global calls
    calls += 1
    if MARKER.exists() and calls > int(MARKER.read_text()):
        Path(__file__).with_name("reward-hung").write_text(str(time.time()))
        time.sleep(3600)
    return float(len(response) % 3 == 0)
"""


@pytest.fixture(scope="module")
def engine_marker(tmp_path_factory: pytest.TempPathFactory):
    """The engines' hang hook, set before the module's Ray starts (its workers read it)."""
    marker = tmp_path_factory.mktemp("hook") / "engine-hangs-after"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(HANG_HOOK_ENV, str(marker))
        yield marker
    marker.unlink(missing_ok=True)


def test_a_hung_reward_then_a_hung_engine_stop_the_run_and_it_resumes(
    tmp_path: Path, engine_marker: Path, local_ray
) -> None:
    (tmp_path / "rewards.py").write_text(REWARD)
    checkpoints = tmp_path / "ckpt"
    settings = {
        "steps": 3,
        "reward": {"function": str(tmp_path / "rewards.py") + ":reward"},
        "rollout": {"n": N, "max_new_tokens": 8},
        "batch": {"prompts_per_step": PROMPTS, "micro_batch_size": 8},
        "checkpoint": {"dir": str(checkpoints), "every": 3, "keep": 2},
    }
    recipe = make_recipe(tmp_path, stall_timeout=STALL_TIMEOUT, **settings)
    env = {"RLX_RUN_ID": "stalls"}
    step_2 = checkpoints / "stalls" / "step-000002"

    def stalled() -> tuple[Stalled, float]:
        started = time.monotonic()
        with pytest.raises(Stalled) as caught:
            run_training(recipe, env, print_summary=False)
        return caught.value, time.monotonic() - started

    # The reward hangs on the first sample of step 3.
    (tmp_path / "reward-hangs-after").write_text(str(2 * PROMPTS * N))
    stall, _ = stalled()
    hung = float((tmp_path / "reward-hung").read_text())
    assert time.time() - hung < STALL_TIMEOUT + 30
    line = str(stall)
    assert stall.exit_code == TRY_AGAIN == 75 and "\n" not in line
    assert line.startswith("step 3 stalled in the reward: nothing finished within 10 s")
    assert "did not answer: reward function " in line and "(sample 0 of 4)" in line
    assert "step 2's checkpoint is kept and a retry resumes there" in line
    saved = sorted(p.name for p in (checkpoints / "stalls").iterdir() if p.name.startswith("step"))
    assert saved == ["step-000002"], saved  # saved at the stall: the ranks still answered
    log = (tmp_path / "runs" / "stalls" / "train.log").read_text()
    assert "step 2 saved at the stall (the training ranks still answered)" in log
    record = (tmp_path / "runs" / "stalls" / "result.json").read_text()
    assert '"exit_code": 75' in record and "stalled in the reward" in record

    # Tried again, the reward answers, and the engine's first call (step 3 again) never does.
    (tmp_path / "reward-hangs-after").unlink()
    engine_marker.write_text("0")
    stall, seconds = stalled()
    line = str(stall)
    assert stall.exit_code == TRY_AGAIN and "\n" not in line
    assert line.startswith("step 3 stalled in the generation: nothing finished within 10 s")
    assert "did not answer: training rank 0 on " in line
    assert "step 2's checkpoint is kept" in line
    print(f"the engine's stall ended the run {seconds:.1f} s after it began")
    assert step_2.is_dir()

    # The third try resumes from step 2 and finishes, under the default watchdog: the 10 s
    # window would also hold the training rank's start-up, which a loaded machine can outlast.
    engine_marker.unlink()
    result = run_training(make_recipe(tmp_path, **settings), env, print_summary=False)
    assert result.state == "SUCCEEDED" and result.last_step == 3
    log = (tmp_path / "runs" / "stalls" / "train.log").read_text()
    assert log.count(f"resumed from {step_2}") == 2, log
