from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlx.trainer.batch import RolloutBatch, pad_responses
from rlx.trainer.model.tiny import build_tiny_model, token_id
from rlx.trainer.rollout import choose_engine, make_engine
from rlx.trainer.rollout.base import SamplingArgs
from rlx.trainer.rollout.hf import HFEngine, mask_after_eos, top_p_filter

EOS = token_id("<|im_end|>")
PAD = token_id("<|pad|>")
PROMPTS = [[10, 20, 30, 40, 50, 60, 70], [5], [100, 101, 102]]  # unequal: left padding matters


def _load(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def _eos_heavy_model(folder: Path, eos_bias: float = 3.0):
    """The tiny model with an untied, biased output layer: EOS gets ~7% of the mass per step,
    so responses end at varied lengths."""
    model = _load(folder)
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[EOS] = eos_bias
    model.config.tie_word_embeddings = False
    model.lm_head = head
    return model


@torch.no_grad()
def _teacher_forced(model, prompt: list[int], response: list[int], temperature: float = 1.0):
    """(R, V) log-probs of the next token at each response position, one unpadded sequence."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def _assert_well_formed(batch: RolloutBatch, n: int, max_new_tokens: int) -> None:
    rows = len(PROMPTS) * n
    assert len(batch) == rows
    assert batch.prompt_ids == [p for p in PROMPTS for _ in range(n)]  # grouped by prompt
    assert batch.response_ids.dtype == torch.long
    assert batch.response_mask.dtype == torch.bool
    assert batch.logprobs.dtype == torch.float32
    assert batch.response_ids.shape == batch.response_mask.shape == batch.logprobs.shape
    assert batch.response_ids.shape[0] == rows
    assert batch.response_ids.shape[1] <= max_new_tokens
    assert batch.n == n
    assert (batch.response_ids[~batch.response_mask] == PAD).all()
    assert (batch.logprobs[~batch.response_mask] == 0).all()
    assert (batch.logprobs[batch.response_mask] < 0).all()
    lengths = batch.response_lengths
    # the mask is a prefix: True then only False
    positions = torch.arange(batch.response_mask.shape[1])
    assert torch.equal(batch.response_mask, positions[None, :] < lengths[:, None])


def _assert_logprobs_match_teacher_forcing(model, batch: RolloutBatch) -> None:
    for row, response in enumerate(batch.response_lists()):
        expected = _teacher_forced(model, batch.prompt_ids[row], response)
        taken = expected.gather(1, torch.tensor(response)[:, None]).squeeze(1)
        assert torch.allclose(batch.logprobs[row, : len(response)], taken, atol=1e-4), row


# ----------------------------------------------------------------------------- helpers


def test_top_p_filter_hand_worked() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = top_p_filter(logits, 0.7).isfinite()
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7 <= 0.5 + 0.3
    assert top_p_filter(logits, 0.8).isfinite().tolist() == [[True, True, False, False]]
    assert top_p_filter(logits, 0.81).isfinite().tolist() == [[True, True, True, False]]
    assert top_p_filter(logits, 0.1).isfinite().tolist() == [[True, False, False, False]]
    assert torch.equal(top_p_filter(logits, 1.0), logits)
    shuffled = logits[:, [2, 0, 3, 1]]  # the rule follows probability, not position
    assert top_p_filter(shuffled, 0.7).isfinite().tolist() == [[False, True, False, True]]


def test_mask_after_eos_and_pad_responses() -> None:
    ids = torch.tensor([[1, 2, 9, 3, 9], [9, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert mask_after_eos(ids, [9]).int().tolist() == [
        [1, 1, 1, 0, 0],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1],
    ]
    assert mask_after_eos(ids, [7, 3]).int().tolist()[0] == [1, 1, 1, 1, 0]
    padded, mask, values = pad_responses([[4, 5], [6]], [[-1.0, -2.0], [-3.0]], pad_token_id=0)
    assert padded.tolist() == [[4, 5], [6, 0]]
    assert mask.tolist() == [[True, True], [True, False]]
    assert values.tolist() == [[-1.0, -2.0], [-3.0, 0.0]]
    with pytest.raises(ValueError, match="response 0: 2 tokens but 1 log-probs"):
        pad_responses([[4, 5]], [[-1.0]], pad_token_id=0)


# ----------------------------------------------------------------------------- HFEngine


def test_shapes_grouping_and_logprobs_match_a_teacher_forced_pass(tiny_model_dir: Path) -> None:
    engine = HFEngine(tiny_model_dir)
    batch = engine.generate(PROMPTS, SamplingArgs(4, max_new_tokens=12), seed=0)
    _assert_well_formed(batch, n=4, max_new_tokens=12)
    _assert_logprobs_match_teacher_forcing(_load(tiny_model_dir), batch)
    # samples of one prompt differ from each other (it is sampling, not greedy)
    assert len({tuple(r) for r in batch.response_lists()[:4]}) > 1


def test_eos_ends_responses_and_everything_after_is_masked(tiny_model_dir: Path) -> None:
    model = _eos_heavy_model(tiny_model_dir)
    engine = HFEngine(model)
    batch = engine.generate(PROMPTS, SamplingArgs(8, max_new_tokens=24), seed=1)
    _assert_well_formed(batch, n=8, max_new_tokens=24)
    lengths = batch.response_lengths.tolist()
    assert batch.finished.any() and not batch.finished.all()  # the test sees both kinds
    assert len(set(lengths)) > 3
    for row, response in enumerate(batch.response_lists()):
        eos_positions = [i for i, t in enumerate(response) if t == EOS]
        if batch.finished[row]:
            assert eos_positions == [len(response) - 1]  # exactly one EOS, and it is last
        else:
            assert eos_positions == [] and len(response) == batch.response_ids.shape[1]
    _assert_logprobs_match_teacher_forcing(model, batch)


def test_generation_that_stops_early_keeps_logprobs_aligned(tiny_model_dir: Path) -> None:
    model = _eos_heavy_model(tiny_model_dir, eos_bias=6.0)
    batch = HFEngine(model).generate(PROMPTS, SamplingArgs(6, max_new_tokens=64), seed=4)
    assert batch.finished.all()
    assert batch.response_ids.shape[1] < 64  # every row ended, so generate stopped early
    assert batch.response_ids.shape[1] == int(batch.response_lengths.max())
    _assert_logprobs_match_teacher_forcing(model, batch)


@pytest.mark.parametrize("step", ["lean", "forward"])
def test_finished_rows_leave_the_batch(tiny_model_dir: Path, step: str) -> None:
    """Each decoding step runs only the rows that have not drawn EOS yet: the step after
    response token k holds exactly the rows longer than k + 1, not every row; with the
    engine's own decode step and with transformers' forward."""
    model = _eos_heavy_model(tiny_model_dir)
    engine = HFEngine(model)
    rows_seen: list[int] = []
    prefills: list[int] = []
    if step == "lean":
        assert engine.decoder is not None
        decode = engine.decoder.step

        def counted(generation, input_ids, *args):  # type: ignore[no-untyped-def]
            rows_seen.append(input_ids.shape[0])
            return decode(generation, input_ids, *args)

        engine.decoder.step = counted  # type: ignore[method-assign]
        seen = prefills
    else:
        engine.decoder = None
        seen = rows_seen
    model.register_forward_pre_hook(
        lambda _m, _args, kwargs: seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    batch = engine.generate(PROMPTS, SamplingArgs(8, max_new_tokens=24), seed=1)
    lengths = batch.response_lengths
    if step == "forward":
        prefills, rows_seen = rows_seen[:1], rows_seen[1:]
    decoding = rows_seen
    assert prefills == [len(PROMPTS)]  # one forward of the distinct prompts
    expected = [int((lengths >= k + 2).sum()) for k in range(len(decoding))]
    assert decoding == expected
    assert decoding[-1] < len(lengths) // 2  # most rows had left by the end
    _assert_logprobs_match_teacher_forcing(model, batch)


def test_growing_cache_layers_equal_concatenation() -> None:
    """The decode loop's cache layers write into a buffer that doubles when full; what they
    hand attention equals transformers' concatenating layer through growth past the first
    buffer and rows leaving, and they never hold room for more than `most` positions."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    from rlx.trainer.model.decode import grow_in_place

    gen = torch.Generator().manual_seed(0)
    prompt = [torch.randn(5, 2, 3, 4, generator=gen) for _ in range(2)]
    plain, grown = DynamicLayer(), DynamicCache()
    plain.update(*prompt)
    grown.layers = [DynamicLayer()]
    grown.layers[0].update(*prompt)
    grow_in_place(grown, most=3 + 70)
    layer = grown.layers[0]
    assert type(layer) is not DynamicLayer
    rows = 5
    leaving = {20: torch.tensor([0, 2, 4]), 50: torch.tensor([1, 2])}  # the rows kept
    for step in range(70):
        if step in leaving:
            plain.batch_select_indices(leaving[step])
            layer.batch_select_indices(leaving[step])
            rows = len(leaving[step])
        new = [torch.randn(rows, 2, 1, 4, generator=gen) for _ in range(2)]
        want, got = plain.update(*new), layer.update(*new)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
        assert layer.get_seq_length() == 3 + step + 1
    assert layer._keys.shape[-2] == 73  # doubled from 64, held at `most`


def test_min_new_tokens_holds_eos_back(tiny_model_dir: Path) -> None:
    engine = HFEngine(_eos_heavy_model(tiny_model_dir, eos_bias=5.0))
    free = engine.generate(PROMPTS, SamplingArgs(8, max_new_tokens=16), seed=2)
    assert (free.response_lengths < 6).any()  # without the floor, some stop early
    held = engine.generate(PROMPTS, SamplingArgs(8, max_new_tokens=16, min_new_tokens=6), seed=2)
    _assert_well_formed(held, n=8, max_new_tokens=16)
    assert (held.response_lengths >= 6).all()
    assert not (held.response_ids[:, :5] == EOS).any()
    assert held.finished.any()  # EOS is allowed again after the floor


def test_tempered_and_top_p_logprobs_are_of_the_sampling_distribution(tiny_model_dir: Path) -> None:
    engine = HFEngine(tiny_model_dir)
    reference = _load(tiny_model_dir)
    for temperature, top_p in ((0.7, 1.0), (1.3, 0.9)):
        batch = engine.generate(
            PROMPTS[:2],
            SamplingArgs(3, max_new_tokens=8, temperature=temperature, top_p=top_p),
            seed=3,
        )
        for row, response in enumerate(batch.response_lists()):
            with torch.no_grad():
                ids = torch.tensor([batch.prompt_ids[row] + response])
                logits = reference(input_ids=ids).logits[0, len(batch.prompt_ids[row]) - 1 : -1]
            expected = torch.log_softmax(top_p_filter(logits.float() / temperature, top_p), dim=-1)
            taken = expected.gather(1, torch.tensor(response)[:, None]).squeeze(1)
            assert torch.allclose(batch.logprobs[row, : len(response)], taken, atol=1e-4)
            untempered = _teacher_forced(reference, batch.prompt_ids[row], response)
            plain = untempered.gather(1, torch.tensor(response)[:, None]).squeeze(1)
            assert not torch.allclose(taken, plain, atol=1e-3)  # the tempering is visible


def test_top_p_restricts_what_is_sampled(tiny_model_dir: Path) -> None:
    engine = HFEngine(tiny_model_dir)
    batch = engine.generate([[1, 2, 3]], SamplingArgs(32, max_new_tokens=1, top_p=0.05), seed=0)
    # a nucleus of 5% over a near-uniform 260-way distribution holds ~13 tokens
    assert len(set(batch.response_ids[:, 0].tolist())) <= 20
    full = engine.generate([[1, 2, 3]], SamplingArgs(32, max_new_tokens=1), seed=0)
    assert full.logprobs[:, 0].max() < batch.logprobs[:, 0].min()  # renormalised nucleus


def test_seeded_sampling_is_reproducible_and_private(tiny_model_dir: Path) -> None:
    engine = HFEngine(tiny_model_dir)
    first = engine.generate(PROMPTS, SamplingArgs(2, max_new_tokens=10), seed=11)
    torch.manual_seed(0)
    expected_global = torch.rand(2)
    torch.manual_seed(0)
    second = engine.generate(PROMPTS, SamplingArgs(2, max_new_tokens=10), seed=11)
    assert torch.equal(torch.rand(2), expected_global)  # the seeded call left it alone
    other = engine.generate(PROMPTS, SamplingArgs(2, max_new_tokens=10), seed=12)
    assert torch.equal(first.response_ids, second.response_ids)
    assert torch.equal(first.logprobs, second.logprobs)
    assert not torch.equal(first.response_ids, other.response_ids)


def test_chunked_generation_gives_the_same_kind_of_batch(tiny_model_dir: Path) -> None:
    engine = HFEngine(tiny_model_dir, max_batch_size=5)
    batch = engine.generate(PROMPTS, SamplingArgs(4, max_new_tokens=6), seed=0)
    _assert_well_formed(batch, n=4, max_new_tokens=6)


def test_checkpoint_sampling_defaults_do_not_leak(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path / "greedy_defaults", seed=0)
    config = (folder / "generation_config.json").read_text()
    (folder / "generation_config.json").write_text(
        config.replace('"bos_token_id"', '"top_k": 1, "temperature": 0.01, "bos_token_id"')
    )
    assert AutoModelForCausalLM.from_pretrained(folder).generation_config.top_k == 1
    batch = HFEngine(folder).generate([[1, 2, 3]], SamplingArgs(8, max_new_tokens=6), seed=0)
    assert len({tuple(r) for r in batch.response_lists()}) > 1  # top_k=1 would make them equal


def test_load_weights_changes_the_probe_and_the_version(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    engine = HFEngine(tiny_model_dir)
    prompt, response = [1, 2, 3, 4], [5, 6, 7]
    before = engine.logprob_probe(prompt, response)
    expected = _teacher_forced(_load(tiny_model_dir), prompt, response)
    assert before == pytest.approx(
        expected.gather(1, torch.tensor(response)[:, None]).sum().item(), abs=1e-4
    )
    assert engine.weight_version == 0

    other = _load(build_tiny_model(tmp_path / "other", seed=1))
    engine.load_weights(other.state_dict(), version=1)
    after = engine.logprob_probe(prompt, response)
    assert engine.weight_version == 1
    assert abs(after - before) > 1e-3
    assert after == pytest.approx(HFEngine(other).logprob_probe(prompt, response), abs=1e-5)
    assert engine.generate(PROMPTS, SamplingArgs(1, max_new_tokens=2), seed=0).weight_version == 1

    # an iterator of (name, tensor) pairs works too, e.g. streamed from another process
    engine.load_weights(iter(_load(tiny_model_dir).named_parameters()), version=2)
    assert engine.weight_version == 2
    assert engine.logprob_probe(prompt, response) == pytest.approx(before, abs=1e-5)


def test_load_weights_errors(tiny_model_dir: Path) -> None:
    engine = HFEngine(tiny_model_dir)
    with pytest.raises(KeyError, match=r"no tensor 'module\.lm_head\.weight'"):
        engine.load_weights({"module.lm_head.weight": torch.zeros(1)}, version=1)
    expected = "'model.norm.weight' has shape (3,), the model expects (64,)"
    with pytest.raises(ValueError, match=re.escape(expected)):
        engine.load_weights({"model.norm.weight": torch.zeros(3)}, version=1)
    with pytest.raises(ValueError, match="no tensors given"):
        engine.load_weights({}, version=1)
    assert engine.weight_version == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be at least 1"),
        ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
        ({"min_new_tokens": 9}, "min_new_tokens must be in"),
        ({"temperature": -1.0}, "temperature must be > 0"),
        ({"top_p": 0.0}, "top_p must be in"),
    ],
)
def test_generate_argument_errors(tiny_model_dir: Path, kwargs: dict, message: str) -> None:
    engine = HFEngine(tiny_model_dir)
    sampling = SamplingArgs(**{"n": 1, "max_new_tokens": 4, **kwargs})
    with pytest.raises(ValueError, match=message):
        engine.generate(PROMPTS, sampling)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], SamplingArgs(1, max_new_tokens=2))


# ----------------------------------------------------------------------------- factory


def test_make_engine(tiny_model_dir: Path) -> None:
    assert isinstance(make_engine("hf", tiny_model_dir), HFEngine)
    with pytest.raises(ValueError, match="unknown rollout engine 'trt'; valid: hf, vllm"):
        make_engine("trt", tiny_model_dir)


def test_auto_is_vllm_on_gpus_and_hf_on_cpu() -> None:
    assert choose_engine("auto", 0) == "hf"
    assert choose_engine("auto", 8) == "vllm"
    assert choose_engine("hf", 8) == "hf"
    assert choose_engine("vllm", 0) == "vllm"
    with pytest.raises(ValueError, match="unknown rollout engine 'trt'; valid: auto, hf, vllm"):
        choose_engine("trt", 0)


def test_vllm_engine_says_how_to_install_it(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The test environment has vLLM's CPU build; a None entry makes `import vllm` fail as it
    # does on a machine without it.
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r'pip install "rlx\[vllm\]"'):
        make_engine("vllm", tiny_model_dir)


def test_logprob_probe_is_a_finite_negative_sum(tiny_model_dir: Path) -> None:
    value = HFEngine(tiny_model_dir).logprob_probe([1, 2], [3, 4, 5])
    assert math.isfinite(value)
    # three near-uniform 260-way choices: about 3 * log(1/260)
    assert value == pytest.approx(3 * math.log(1 / 260), abs=0.5)


def test_close_releases_the_model(tiny_model_dir: Path) -> None:
    engine = HFEngine(tiny_model_dir)
    engine.close()
    assert not hasattr(engine, "model")


def test_buckets_follow_the_plan_and_keep_their_bound() -> None:
    from rlx.trainer.weights import bucket_plan, buckets

    tensors = [(f"t{i}", torch.zeros(size)) for i, size in enumerate([10, 30, 5, 100, 1, 1, 40])]
    sizes = [(name, t.numel() * 4) for name, t in tensors]
    plan = bucket_plan(sizes, 160)
    assert plan == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"], ["t6"]]
    streamed = [[name for name, _ in bucket] for bucket in buckets(iter(tensors), 160)]
    assert streamed == plan  # the sender's plan and the stream agree, bucket for bucket
    for names in plan:
        alone = len(names) == 1
        assert alone or sum(dict(sizes)[n] for n in names) <= 160  # a large tensor goes alone
    assert [n for names in plan for n in names] == [n for n, _ in tensors]  # order kept
    assert bucket_plan(sizes, 10**9) == [[n for n, _ in tensors]]  # one object: the whole
    assert bucket_plan([], 160) == []


def test_a_bucket_layout_places_every_tensor_in_one_buffer() -> None:
    from rlx.trainer.weights import ALIGN, BucketLayout

    gen = torch.Generator().manual_seed(0)
    tensors = [
        ("a", torch.randn(3, 5, generator=gen)),
        ("b", torch.randn(7, generator=gen)),  # odd byte count in bf16
        ("c", torch.randn(2, 3, generator=gen).t()),  # not contiguous
        ("d", torch.randn((), generator=gen)),
    ]
    layout = BucketLayout.of([(n, tuple(t.shape)) for n, t in tensors], torch.bfloat16)
    assert all(offset % ALIGN == 0 for offset in layout.offsets)
    assert BucketLayout.from_wire(layout.to_wire()) == layout  # travels as plain values
    buffer = layout.empty()
    for (_, view), (_, tensor) in zip(layout.views(buffer), tensors, strict=True):
        view.copy_(tensor)  # the sender writes each tensor, cast, into its place
    back = layout.views(buffer.clone())  # what a receiver's buffer holds
    assert [name for name, _ in back] == list("abcd")
    for (_, want), (_, got) in zip(tensors, back, strict=True):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert torch.equal(got, want.to(torch.bfloat16))


def test_views_of_a_bucket_pickle_as_themselves() -> None:
    """A tensor that views a larger buffer is copied before it is pickled to vLLM's workers:
    pickle writes a view's whole storage, so a bucket would travel once per tensor."""
    import pickle

    from rlx.trainer.rollout.vllm import _own_storage
    from rlx.trainer.weights import BucketLayout

    tensors = [(f"t{i}", torch.full((1000,), float(i))) for i in range(8)]
    layout = BucketLayout.of([(n, tuple(t.shape)) for n, t in tensors], torch.float32)
    buffer = layout.empty()
    views = layout.views(buffer)
    for (_, view), (_, tensor) in zip(views, tensors, strict=True):
        view.copy_(tensor)
    whole = sum(len(pickle.dumps(t)) for _, t in views)
    owned = [_own_storage(t) for _, t in views]
    assert sum(len(pickle.dumps(t)) for t in owned) < whole / 4
    assert all(torch.equal(a, b) for a, (_, b) in zip(owned, tensors, strict=True))
    alone = torch.zeros(10)
    assert _own_storage(alone) is alone  # no copy when there is nothing to trim
