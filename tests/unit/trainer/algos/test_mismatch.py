"""The engine/learner mismatch figures against hand-computed values."""

import math

import torch

from rlx.trainer.algos.mismatch import MISMATCH_METRICS, mismatch_metrics


def test_agreement_is_zero_and_padding_is_ignored():
    logp = torch.tensor([[-0.5, -1.0, float("nan")], [-2.0, float("-inf"), 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    got = mismatch_metrics(logp, logp.clone(), mask)
    assert got == {f"mismatch/{name}": 0.0 for name in MISMATCH_METRICS}


def test_hand_computed_figures():
    f64 = torch.float64  # exact enough to compare with math's figures at 1e-12
    engine = torch.tensor([[math.log(0.5), math.log(0.25)], [math.log(0.8), 0.0]], dtype=f64)
    learner = torch.tensor([[math.log(0.25), math.log(0.25)], [math.log(0.4), 5.0]], dtype=f64)
    mask = torch.tensor([[1, 1], [1, 0]])
    got = mismatch_metrics(engine, learner, mask)
    # r = learner / engine per valid token: 0.5, 1, 0.5; k3 = r - 1 - log r.
    k3_half = 0.5 - 1 - math.log(0.5)
    assert math.isclose(got["mismatch/kl"], (2 * k3_half + 0.0) / 3, rel_tol=1e-12)
    # log engine - log learner: log 2, 0 (row 0, mean log2/2) and log 2 (row 1).
    assert math.isclose(got["mismatch/log_ppl_diff"], (math.log(2) / 2 + math.log(2)) / 2)
    assert math.isclose(got["mismatch/max_abs_logprob_diff"], math.log(2), rel_tol=1e-12)
    assert math.isclose(got["mismatch/max_abs_prob_diff"], 0.4, rel_tol=1e-12)


def test_no_valid_token_measures_nothing():
    logp = torch.zeros(2, 3)
    got = mismatch_metrics(logp, logp, torch.zeros(2, 3))
    assert all(math.isnan(value) for value in got.values())
