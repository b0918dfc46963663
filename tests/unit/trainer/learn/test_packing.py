"""Packed sequences are exact: a packed forward's per-token log-probs, values and gradients
equal each sequence's run alone (policy, reference, critic), with a dense mask and with
segment attention (the layout alone), and the negative controls, a 2-D mask or a cache
handed to a packed forward, a wrong mask or a wrong layout, are caught by the same
comparison. The first step's check turns packing off, in one line, where attention mixes
the sequences."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlx.trainer.batch import (
    OLD_LOGP,
    REF_LOGP,
    RETURNS,
    VALUES,
    RolloutBatch,
    SequenceBatch,
    pack_rollout,
    pad_responses,
)
from rlx.trainer.learn.learner import Learner
from rlx.trainer.learn.scoring import ResponseScorer, score_responses
from rlx.trainer.model.attention import LAYOUT_KEYWORD, register, use_segment_attention
from rlx.trainer.model.prefill import prompt_groups
from rlx.trainer.model.tiny import build_tiny_model
from rlx.trainer.model.traits import SEGMENT_ATTENTION, traits
from rlx.trainer.packing import (
    PackedRows,
    pack_rows,
    plan_passes,
    segment_lengths,
    sequence_lengths,
    shared_segments,
)
from tests.support.gradients import (
    assert_same_gradients,
    gradient_of_update,
    record_gradients,
)
from tests.support.recipes import small_trainer

pytestmark = pytest.mark.timeout(300)

# float32: a few units of its resolution at the log-probs' size (about 6 here: 4.8e-7 a unit);
# measured 9.5e-7 at most on this machine's CPU
LOGPROB_TOLERANCE = 3e-6
GRADIENT_TOLERANCE = 1e-5  # relative to the largest gradient entry


def packed_layout(batch: SequenceBatch, row_tokens: int = 40, masks: bool = True) -> PackedRows:
    """The batch in rows of at most row_tokens tokens: several sequences share each row."""
    rows = [row for p in plan_passes(sequence_lengths(batch), 10**6, row_tokens) for row in p]
    assert max(len(row) for row in rows) > 1
    return pack_rows(batch, rows, masks=masks)


def shared_layout(batch: SequenceBatch, row_tokens: int = 40, masks: bool = True) -> PackedRows:
    """The batch's sequences gathered by prompt into segments that run it once, the segments
    in rows of at most row_tokens: a prompt's responses span several segments and rows, and
    rows hold segments of several prompts."""
    width = batch.prompt_width
    groups = prompt_groups(batch.input_ids[:, :width], batch.attention_mask[:, :width])
    assert groups is not None
    lengths = sequence_lengths(batch)
    prompts = batch.attention_mask[:, :width].sum(dim=1).tolist()
    segments = shared_segments(lengths, prompts, groups[1].tolist(), row_tokens)
    sizes = segment_lengths(segments, lengths, prompts)
    rows = [[segments[s] for s in row] for p in plan_passes(sizes, 10**6, row_tokens) for row in p]
    assert max(len(segment) for row in rows for segment in row) > 1  # prompts really shared
    assert len(segments) > len(set(groups[1].tolist()))  # and one prompt in several segments
    assert max(len(row) for row in rows) > 1  # rows hold several segments
    return pack_rows(batch, rows, masks=masks)


def one_by_one(scorer: ResponseScorer, batch: SequenceBatch) -> torch.Tensor:
    """(B, R) log-probs, each sequence run alone (a batch of one, no padding)."""
    out = torch.zeros(batch.response_mask.shape)
    for row in range(len(batch)):
        alone = batch.select([row]).trimmed()
        logprobs = score_responses(scorer, alone, 1.0, entropy_grad=False).logprobs  # (1, r)
        out[row, : logprobs.shape[1]] = logprobs[0]
    return out


def max_gap(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor) -> float:
    return float((got.detach() - want.detach()).abs()[mask].max())


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path) -> ResponseScorer:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return ResponseScorer(model.eval())


def assert_packed_equals_alone(
    scorer: ResponseScorer, batch: SequenceBatch, packed: PackedRows
) -> torch.Tensor:
    """The packed forward's per-token log-probs, and the gradients of a weighted sum of them,
    equal those of each sequence run alone; returns the packed (B, R) log-probs."""
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(1))
    mask = batch.response_mask
    named = list(scorer.named_parameters())

    def gradient(loss: torch.Tensor) -> dict[str, torch.Tensor]:
        scorer.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.detach().double().clone() for n, p in named if p.grad is not None}

    alone = one_by_one(scorer, batch)
    want = gradient((alone * weights)[mask].sum())
    scores = score_responses(scorer, batch, 1.0, entropy_grad=False, packed=packed)
    assert max_gap(scores.logprobs, alone, mask) <= LOGPROB_TOLERANCE
    got = gradient((scores.logprobs * weights)[mask].sum())
    assert_same_gradients(got, want, relative=GRADIENT_TOLERANCE)
    return scores.logprobs


def test_packed_log_probs_and_gradients_equal_each_sequence_alone(
    policy: ResponseScorer, advantage_batch: SequenceBatch
) -> None:
    batch = advantage_batch
    logprobs = assert_packed_equals_alone(policy, batch, packed_layout(batch))
    assert bool((logprobs[~batch.response_mask] == 0).all())  # nothing off the responses


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_rows_that_share_prompts_equal_each_sequence_alone(
    tiny_model_dir: Path, advantage_batch: SequenceBatch, attention: str
) -> None:
    """A prompt run once for several responses (a 4-D mask: its prompt and its own response)
    scores every token and gives every gradient as each sequence run alone does, with SDPA
    and with eager attention (which adds the mask as 0/-inf)."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation=attention
    )
    packed = shared_layout(advantage_batch)
    assert packed.real_tokens < advantage_batch.num_tokens  # the prompts placed fewer times
    assert_packed_equals_alone(ResponseScorer(model.eval()), advantage_batch, packed)


@pytest.mark.parametrize("wrong", ["position ids only", "siblings seen"])
def test_the_comparison_catches_a_shared_row_masked_wrongly(
    policy: ResponseScorer, advantage_batch: SequenceBatch, wrong: str
) -> None:
    """Shared rows need their 4-D mask: without it the second response of a segment no
    longer sees its prompt; with a mask that lets responses see earlier siblings they
    attend to each other. Both differ far beyond rounding."""
    batch = advantage_batch
    packed = shared_layout(batch)
    assert packed.attention is not None
    if wrong == "position ids only":
        attention = None
    else:
        flat = packed.position_ids  # (k, T); siblings share positions: mask by row order
        order = torch.arange(flat.shape[1])
        causal = order[None, :, None] >= order[None, None, :]  # (1, T, T)
        attention = (packed.attention.squeeze(1) | causal).unsqueeze(1)
    broken = PackedRows(
        packed.input_ids, packed.position_ids, packed.score_index, packed.real_tokens, attention
    )
    with torch.no_grad():
        alone = one_by_one(policy, batch)
        got = score_responses(policy, batch, 1.0, entropy_grad=False, packed=broken).logprobs
    gap = max_gap(got, alone, batch.response_mask)
    assert gap > 1e3 * LOGPROB_TOLERANCE, f"a wrongly masked shared row went unseen ({gap})"


@pytest.fixture(scope="module", params=["tiny", "grouped-query"])
def segment_policy(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> ResponseScorer:
    """A policy switched to segment attention: the tiny model, and one whose two query heads
    share a key/value head."""
    folder = tiny_model_dir
    if request.param == "grouped-query":
        folder = build_tiny_model(
            tmp_path_factory.mktemp("gqa") / "model", hidden_size=128, num_kv_heads=1
        )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    use_segment_attention(model)
    assert traits(model).attends_by_segments
    return ResponseScorer(model.eval())


@pytest.mark.parametrize("layout", ["one sequence a segment", "shared prompts"])
def test_segment_attention_equals_each_sequence_alone(
    segment_policy: ResponseScorer, advantage_batch: SequenceBatch, layout: str
) -> None:
    """Rows attended by their layout alone (no mask at all) score every token and give every
    gradient as each sequence run alone does, padding tails included."""
    make = packed_layout if layout == "one sequence a segment" else shared_layout
    packed = make(advantage_batch, masks=False)
    assert packed.attention is None
    widths = [sum(p + sum(r) for _, p, r in row) for row in packed.layout]
    assert min(widths) < packed.input_ids.shape[1]  # a row with a padding tail
    assert_packed_equals_alone(segment_policy, advantage_batch, packed)


@pytest.mark.parametrize("wrong", ["siblings seen", "prompt dropped"])
def test_the_comparison_catches_a_wrong_layout(
    segment_policy: ResponseScorer, advantage_batch: SequenceBatch, wrong: str
) -> None:
    """The negative controls of segment attention: a shared segment run as one causal
    block (its responses see the ones before them), or its responses run without their
    prompt. Both differ far beyond rounding."""
    batch = advantage_batch
    packed = shared_layout(batch, masks=False)
    rows = []
    for row in packed.layout:
        placed = []
        for start, prompt, responses in row:
            if len(responses) < 2:
                placed.append((start, prompt, responses))
            elif wrong == "siblings seen":
                placed.append((start, prompt + sum(responses), ()))
            else:
                placed.append((start, prompt, ()))
                offset = start + prompt
                for length in responses:
                    placed.append((offset, length, ()))
                    offset += length
        rows.append(tuple(placed))
    broken = dataclasses.replace(packed, layout=tuple(rows))
    with torch.no_grad():
        alone = one_by_one(segment_policy, batch)
        got = score_responses(segment_policy, batch, 1.0, entropy_grad=False, packed=broken)
    gap = max_gap(got.logprobs, alone, batch.response_mask)
    assert gap > 1e3 * LOGPROB_TOLERANCE, f"a wrong layout went unseen ({gap})"


def test_segment_attention_is_sdpa_outside_packed_passes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Forwards without a layout (padded passes, generation) attend as SDPA does, bit for
    bit, and a saved model keeps no trace of the switch: it loads anywhere as it was."""
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    switched = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    use_segment_attention(switched)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        want = plain(input_ids=ids, attention_mask=mask).logits
        got = switched(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got[mask.bool()], want[mask.bool()])
    switched.save_pretrained(tmp_path / "saved")
    assert SEGMENT_ATTENTION not in (tmp_path / "saved" / "config.json").read_text()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert traits(again).attention == "sdpa"


def test_the_learner_attends_by_segments_in_one_row_a_pass(
    tmp_path: Path, tiny_model_dir: Path, advantage_batch: SequenceBatch
) -> None:
    """SDPA models over full attention: the learner's passes are one row each, no mask."""
    one = learner(tmp_path, tiny_model_dir, True)
    assert one.planner.by_segments and "segment attention" in one.planner.note
    passes = one.planner.passes(advantage_batch)
    assert all(p.packed is not None and len(p.packed) == 1 for p in passes)
    _, packed = one.planner.pass_inputs(advantage_batch, passes[0])
    assert packed is not None and packed.attention is None and len(packed.layout) == 1
    assert packed.positions == packed.real_tokens  # no padding


def test_segments_share_a_prompt_and_respect_the_row() -> None:
    lengths = [10 + r for r in (30, 5, 20, 8)] + [4 + r for r in (3, 50)]
    prompts = [10] * 4 + [4] * 2
    segments = shared_segments(lengths, prompts, [0, 0, 0, 0, 1, 1], row_tokens=50)
    # prompt 0: 30 first (10 + 30), then 20 does not fit, 8 does (48), 5 joins 20 (35);
    # prompt 1: 50 is over the row (a segment of its own), 3 starts another
    assert segments == [[0, 3], [1, 2], [5], [4]]
    assert segment_lengths(segments, lengths, prompts) == [48, 35, 54, 7]
    ids, mask, logprobs = pad_responses([[7, 7], [7, 7]], [[0.0] * 2] * 2, 0)
    two = pack_rollout(RolloutBatch([[5, 5], [6, 6]], ids, mask, logprobs, mask[:, 0], 1, 0, 0))
    with pytest.raises(ValueError, match="share a segment but not a prompt"):
        pack_rows(two, [[[0, 1]]])


def contaminated_logprobs(
    scorer: ResponseScorer, packed: PackedRows, batch: SequenceBatch, *, two_d_mask: bool
) -> torch.Tensor:
    """A packed forward called wrongly: an all-ones 2-D mask, or the cache left on."""
    body = scorer.lm.get_decoder()
    hidden = body(
        input_ids=packed.input_ids,
        attention_mask=torch.ones_like(packed.input_ids) if two_d_mask else None,
        position_ids=packed.position_ids,
        use_cache=not two_d_mask,
    ).last_hidden_state.flatten(0, 1)[packed.score_index]
    logits = scorer.lm.get_output_embeddings()(hidden).float()
    targets = packed.input_ids.flatten()[packed.score_index + 1]
    logprobs = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    return torch.zeros(batch.response_mask.shape).masked_scatter(batch.response_mask, logprobs)


@pytest.mark.parametrize("two_d_mask", [True, False], ids=["2-D mask", "cache"])
def test_the_comparison_catches_a_packed_forward_called_wrongly(
    policy: ResponseScorer, advantage_batch: SequenceBatch, two_d_mask: bool
) -> None:
    batch = advantage_batch
    with torch.no_grad():
        alone = one_by_one(policy, batch)
        packed = packed_layout(batch)
        wrong = contaminated_logprobs(policy, packed, batch, two_d_mask=two_d_mask)
    gap = max_gap(wrong, alone, batch.response_mask)
    assert gap > 1e3 * LOGPROB_TOLERANCE, f"sequences attending to each other went unseen ({gap})"


def learner(tmp_path: Path, model: Path, packing: bool) -> Learner:
    conf = small_trainer(
        tmp_path,
        algorithm="ppo",
        # micro-batches of one: the unpacked learner runs each sequence alone
        batch={"micro_batch_size": 1, "packing": packing, "max_tokens_per_micro_batch": 64},
        algo={"kl": {"coef": 0.1, "mode": "loss"}},
        optim={"grad_clip": 1e9},
        rollout={"n": 4, "max_new_tokens": 12, "max_staleness": 1},  # old log-probs computed
    )
    return Learner(conf, str(model), str(model), torch.device("cpu"))


def test_the_learners_reference_critic_and_update_equal_sequences_run_alone(
    tmp_path: Path, tiny_model_dir: Path, advantage_batch: SequenceBatch
) -> None:
    packed, alone = (learner(tmp_path, tiny_model_dir, p) for p in (True, False))
    assert packed.planner.packing and not alone.planner.packing
    for one in (packed, alone):  # the value head starts at zero: give it values to compare
        generator = torch.Generator().manual_seed(3)
        head = one.critic.value_head
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=generator))
    assert packed.planner.share_prompts
    rows = [row for one in packed.planner.passes(advantage_batch) for row in one.packed or []]
    assert max(sum(len(segment) for segment in row) for row in rows) > 1  # rows are shared
    assert max(len(segment) for row in rows for segment in row) > 1  # and prompts too
    want = alone.prepare(advantage_batch, old_logprobs=True)
    got = packed.prepare(advantage_batch, old_logprobs=True)
    mask = advantage_batch.response_mask
    for name in (REF_LOGP, OLD_LOGP, VALUES):
        size = max(1.0, float(want[name][mask].abs().max()))  # values run larger than 6
        assert max_gap(got[name], want[name], mask) <= LOGPROB_TOLERANCE * size / 6, name
    batch = advantage_batch.with_fields(
        **want, **{RETURNS: torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))}
    )
    critics = []
    for one in (packed, alone):
        recorder = record_gradients(one.critic)
        one.critic_optimizer = recorder
        critics.append(recorder)
    policy_got = gradient_of_update(packed, batch)
    policy_want = gradient_of_update(alone, batch)
    assert_same_gradients(policy_got, policy_want, relative=GRADIENT_TOLERANCE)
    assert_same_gradients(critics[0].gradients, critics[1].gradients, relative=GRADIENT_TOLERANCE)


@pytest.fixture
def sdpa_without_masks() -> Iterator[None]:
    """SDPA as a kernel that ignores masks would run it, and segment attention as one that
    ignores the layout: causal over the whole row."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def unmasked(module, query, key, value, attention_mask, **kwargs):  # type: ignore[no-untyped-def]
        kwargs.pop(LAYOUT_KEYWORD, None)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)

    register()
    originals = {name: ALL_ATTENTION_FUNCTIONS[name] for name in ("sdpa", SEGMENT_ATTENTION)}
    for name in originals:
        ALL_ATTENTION_FUNCTIONS[name] = unmasked
    try:
        yield
    finally:
        for name, original in originals.items():
            ALL_ATTENTION_FUNCTIONS[name] = original


def test_the_first_step_check_keeps_exact_packing_on(
    tmp_path: Path, tiny_model_dir: Path, advantage_batch: SequenceBatch
) -> None:
    one = learner(tmp_path, tiny_model_dir, True)
    one.check_packing(advantage_batch)
    assert one.planner.packing and one.take_notes() == []


def test_the_first_step_check_turns_mixing_attention_off_in_one_line(
    tmp_path: Path, tiny_model_dir: Path, advantage_batch: SequenceBatch, sdpa_without_masks: None
) -> None:
    one = learner(tmp_path, tiny_model_dir, True)
    stats = one.update(
        advantage_batch.with_fields(
            **one.prepare(advantage_batch, old_logprobs=True),
            **{RETURNS: torch.zeros(advantage_batch.response_mask.shape)},
        ),
        1,
    )
    assert not one.planner.packing
    (note,) = stats.notes
    assert note.startswith("packing: off, a packed row's log-probs differ") and "\n" not in note
    assert all(p.packed is None for p in one.planner.passes(advantage_batch))


def grpo_batch(prompt: int, responses: list[int]) -> SequenceBatch:
    """One prompt of `prompt` tokens sampled len(responses) times, with those lengths."""
    answers = [[7] * length for length in responses]
    ids, mask, logprobs = pad_responses(answers, [[0.0] * n for n in responses], 0)
    rollout = RolloutBatch(
        [[5] * prompt] * len(responses),
        ids,
        mask,
        logprobs,
        torch.ones(len(responses)) > 0,
        4,
        0,
        0,
    )
    return pack_rollout(rollout)


@pytest.mark.parametrize(
    ("packing", "prompt", "responses", "packed"),
    [
        (None, 8, [40, 3, 90, 12], True),  # ragged responses: packing computes less
        (None, 90, [4, 3, 4, 2], True),  # a long shared prompt: packed rows run it once too
        (True, 90, [4, 3, 4, 2], True),
        (False, 8, [40, 3, 90, 12], False),
    ],
)
def test_unset_packing_packs_where_it_computes_fewer_positions(
    tmp_path: Path, tiny_model_dir: Path, packing, prompt, responses, packed
) -> None:
    conf = small_trainer(tmp_path, batch={"micro_batch_size": 4, "packing": packing})
    one = Learner(conf, str(tiny_model_dir), None, torch.device("cpu"))
    passes = one.planner.passes(grpo_batch(prompt, responses))
    assert all((p.packed is not None) == packed for p in passes)
