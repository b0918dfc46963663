"""Sharded and replicated training against one unsharded process, with real gloo process
groups: the same losses and gradients (policy with its reference, PPO critic), the same
global gradient norm, weights loaded exactly, a rank's host memory about its shard; and the
memory-light pieces (chunked log-probs, token-budget micro-batches) against the plain ones."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rlx.trainer.batch import (
    ADVANTAGES,
    REF_LOGP,
    RETURNS,
    VALUES,
    SequenceBatch,
    micro_batch_rows,
    pack_rollout,
)
from rlx.trainer.learn.learner import Learner, UpdateStats, merge_update_stats
from rlx.trainer.packing import plan_passes
from rlx.trainer.rollout.base import SamplingArgs
from rlx.trainer.rollout.hf import HFEngine
from rlx.trainer.weights import Traffic
from tests.support.gradients import (
    assert_same_gradient,
    assert_same_gradients,
    gradient_of_update,
    record_gradients,
)
from tests.support.processes import fork_ranks
from tests.support.recipes import make_recipe, small_trainer

pytestmark = pytest.mark.timeout(300)

# 4 prompts x 3 samples: 12 rows split evenly over 1, 2 or 3 ranks.
PROMPTS = [[256, 72, 105], [256, 65, 66, 67, 68], [256, 49], [256, 100, 101, 102]]
LOSS_TOLERANCE = 1e-6  # relative
# What each rank generates through the sharded policy (the third one nothing: it only joins
# the others' forwards), and a probe sequence every rank scores.
RANK_PROMPTS = [PROMPTS[:2], PROMPTS[2:3], []]
PROBE = ([256, 72, 105], [106, 107, 108])
GRADIENT_TOLERANCE = 1e-5  # relative to the largest gradient entry


def ppo_settings(tmp: Path, **batch: Any):
    trainer = make_recipe(
        tmp,
        algorithm="ppo",
        rollout={"n": 3, "max_new_tokens": 10},
        algo={"kl": {"coef": 0.05, "mode": "loss"}, "entropy_coef": 0.01},
        optim={"grad_clip": 1e9},
        batch={"prompts_per_step": 4, "micro_batch_size": 2, **batch},
    ).trainer
    assert trainer is not None
    return trainer


def parallel_settings(tmp: Path, strategy: str, **batch: Any):
    base = ppo_settings(tmp, **batch)
    return base.model_copy(
        update={"parallel": base.parallel.model_copy(update={"strategy": strategy})}
    )


def one_update(learner: Learner, batch: SequenceBatch) -> tuple[dict, dict, UpdateStats]:
    """The policy's and the critic's gradients of one update, and its statistics."""
    learner.optimizer = policy = record_gradients(learner.policy)
    assert learner.critic is not None
    learner.critic_optimizer = critic = record_gradients(learner.critic)
    stats = learner.update(batch, step=1)
    return policy.gradients, critic.gradients, stats


@pytest.fixture(scope="module")
def ppo_step_batch(tiny_model_dir: Path) -> SequenceBatch:
    rollout = HFEngine(tiny_model_dir).generate(PROMPTS, SamplingArgs(3, max_new_tokens=10), seed=0)
    batch = pack_rollout(rollout)
    generator = torch.Generator().manual_seed(0)
    mask = batch.response_mask
    advantages = torch.where(mask, torch.randn(mask.shape, generator=generator), 0.0)
    returns = torch.where(mask, torch.rand(mask.shape, generator=generator), 0.0)
    return batch.with_fields(**{ADVANTAGES: advantages, RETURNS: returns})


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory, tiny_model_dir: Path, ppo_step_batch: SequenceBatch) -> dict:
    """One process over the whole batch: what every layout must reproduce."""
    tmp = tmp_path_factory.mktemp("unsharded")
    learner = Learner(
        ppo_settings(tmp), str(tiny_model_dir), str(tiny_model_dir), torch.device("cpu")
    )
    prepared = learner.prepare(ppo_step_batch, old_logprobs=False)
    # Reference log-probs away from the policy's, so that the KL term has a gradient.
    mask = ppo_step_batch.response_mask
    shift = torch.rand(mask.shape, generator=torch.Generator().manual_seed(2)) - 0.5
    batch = ppo_step_batch.with_fields(
        **{**prepared, REF_LOGP: torch.where(mask, prepared[REF_LOGP] + shift, 0.0)}
    )
    policy, critic, stats = one_update(learner, batch)
    torch.save(batch, tmp / "batch.pt")
    engine = HFEngine(tiny_model_dir)
    generated = [
        engine.generate(
            prompts, SamplingArgs(2, max_new_tokens=6 + 2 * index), seed=index
        ).response_ids
        for index, prompts in enumerate(RANK_PROMPTS)
        if prompts
    ]
    return {
        "generated": generated,
        "probe": engine.logprob_probe(PROBE[0], PROBE[1]),
        "dir": tmp,
        "batch": batch,
        "prepared": prepared,
        "policy": policy,
        "critic": critic,
        "metrics": merge_update_stats([stats]),
    }


def _peak_anonymous_memory(stop: threading.Event, out: list[int]) -> None:
    """Sample the process's anonymous resident memory (file pages of the mmapped checkpoint
    excluded) until stopped; out[0] ends as the peak seen."""
    while not stop.is_set():
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    out[0] = max(out[0], int(line.split()[1]) * 1024)
        time.sleep(0.002)


def own_passes(learner: Learner, batch: SequenceBatch, budget: int) -> int:
    """Passes a rank needs for `batch` under a token budget, packed (the default) as the
    learner packs: its segments (prompts shared) in rows of its row size."""
    _, lengths = learner.planner.segments(batch)
    return len(plan_passes(lengths, budget, min(budget, learner.planner.row_tokens)))


def uneven_budget(learner: Learner, batch: SequenceBatch, world: int) -> int:
    """A token budget under which the ranks' shares need different numbers of passes, so
    that the padding passes that keep FSDP's collectives in step are exercised."""
    share = len(batch) // world
    for budget in range(20, 80):
        counts = {
            own_passes(learner, batch.select(range(r * share, (r + 1) * share)), budget)
            for r in range(world)
        }
        if len(counts) > 1:
            return budget
    raise AssertionError("no token budget splits the ranks unevenly")


def _rank(rank: int, world: int, strategies: str, model: str, big_model: str, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/init-{world}", rank=rank, world_size=world
    )
    for strategy in strategies.split(","):
        _run_strategy(rank, world, strategy, model, big_model, tmp)
    dist.barrier()
    dist.destroy_process_group()


def _run_strategy(rank: int, world: int, strategy: str, model: str, big_model: str, tmp: str):
    from safetensors.torch import load_file

    from rlx.trainer.learn import sharding as parallel
    from rlx.trainer.learn.models import load_causal_lm

    results: dict[str, Any] = {}
    folder = Path(tmp)
    batch: SequenceBatch = torch.load(folder / "batch.pt", weights_only=False)
    share = len(batch) // world
    mine = batch.select(range(rank * share, (rank + 1) * share))
    conf = parallel_settings(folder, strategy)
    learner = Learner(conf, model, model, torch.device("cpu"), rank=rank, world_size=world)
    results["strategy"] = learner.strategy

    # Loaded weights: the files' values exactly, the value head at zero.
    saved = load_file(os.path.join(model, "model.safetensors"))
    policy_state = parallel.full_state_dict(learner.policy)
    critic_state = parallel.full_state_dict(learner.critic)
    reference_state = parallel.full_state_dict(learner.reference)
    if rank == 0:
        diff = 0.0
        for name, tensor in policy_state.items():
            key = name if name in saved else "model.embed_tokens.weight"  # tied head
            diff = max(diff, float((tensor - saved[key]).abs().max()))
            diff = max(diff, float((reference_state[name] - saved[key]).abs().max()))
        for name, tensor in critic_state.items():
            if name.startswith("value_head"):
                diff = max(diff, float(tensor.abs().max()))
            else:
                diff = max(diff, float((tensor - saved["model." + name[5:]]).abs().max()))
        results["load_diff"] = diff
        results["tied"] = learner.policy.lm_head.weight is learner.policy.model.embed_tokens.weight

    # The forwards before an update (reference, critic), each rank on its share.
    prepared = learner.prepare(mine.with_fields(), old_logprobs=True)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, prepared)
    if rank == 0:
        results["prepared"] = {
            name: torch.cat([part[name] for part in gathered]) for name in prepared
        }

    # One update: gradients of the policy (with KL and entropy terms) and of the critic.
    policy, critic, stats = one_update(learner, mine)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, stats)
    if rank == 0:
        results.update(policy=policy, critic=critic, metrics=merge_update_stats(everyone))

    # Clipping by the global norm: after clip_grad_norm(max = norm / 2) the gathered
    # gradients are the unclipped ones halved.
    loss, _ = learner.policy_loss(
        mine.to(learner.device), *learner._global_counts(mine.response_mask)
    )
    (loss * learner.loss_scale).backward()
    params = list(learner.policy.parameters())
    before = {
        name: grad.clone()
        for name, grad in parallel.full_state_dict(_Grads(params), rank0_only=False).items()
    }
    norm = float(parallel.clip_grad_norm(params, 1e30))  # measures, clips nothing
    norm = float(parallel.clip_grad_norm(params, norm / 2))
    after = parallel.full_state_dict(_Grads(params), rank0_only=False)
    total = sum(float(g.double().pow(2).sum()) for g in before.values()) ** 0.5
    if rank == 0:
        results["clip"] = (norm, total, before, after)
    learner.policy.zero_grad(set_to_none=True)

    # Generation through the sharded policy (colocated engine): every rank its own prompts
    # and length, an idle rank joins; and the probe every rank scores.
    if strategy == "fsdp":
        from rlx.trainer.rollout.colocated import make_colocated_engine

        engine = make_colocated_engine(
            "hf",
            learner.policy,
            model,
            dtype="float32",
            options={},
            collective=learner.collective,
        ).engine
        prompts = RANK_PROMPTS[rank]
        with learner.no_grad():
            if prompts:
                ids = engine.generate(
                    prompts, SamplingArgs(2, max_new_tokens=6 + 2 * rank), seed=rank
                )
                out = ids.response_ids
            else:
                engine.take_part(8)
                out = None
        outs: list[Any] = [None] * world
        dist.all_gather_object(outs, out)
        probe = learner.probe(*PROBE)
        if rank == 0:
            results["generated"] = [o for o in outs if o is not None]
            results["probe"] = probe

        # A push to split engines, in bf16: each rank sends its rows straight into rank 0's
        # bucket buffers; what every rank moved is counted.
        layouts = parallel.push_layouts(learner.policy, torch.bfloat16, 60_000)
        pushed, moved = [], Traffic()
        for layout in layouts:
            buffer = layout.empty() if rank == 0 else None
            moved.add(parallel.fill_bucket(learner.policy, layout, buffer, torch.device("cpu")))
            if buffer is not None:
                pushed += [(name, view.clone()) for name, view in layout.views(buffer)]
        traffic: list[Any] = [None] * world
        dist.all_gather_object(traffic, moved)
        if rank == 0:
            results["pushed"] = (len(layouts), pushed, policy_state, traffic)

    # Token-budget micro-batches: ranks make different numbers of passes, same gradient.
    # (The same learner, its settings swapped for ones with a budget: nothing has stepped.)
    tokens = uneven_budget(learner, batch, world)
    learner.settings = parallel_settings(folder, strategy, max_tokens_per_micro_batch=tokens)
    counts: list[Any] = [None] * world
    assert learner.planner.packing
    dist.all_gather_object(counts, own_passes(learner, mine, tokens))
    policy, critic, _ = one_update(learner, mine)
    if rank == 0:
        results["budget"] = (counts, policy, critic)
    del learner

    # Non-reentrant gradient checkpointing through the sharded layers: the same gradients.
    if strategy == "fsdp":
        base = parallel_settings(folder, strategy)
        model_settings = base.model.model_copy(update={"gradient_checkpointing": True})
        conf = base.model_copy(update={"model": model_settings, "critic_model": model_settings})
        checkpointed = Learner(conf, model, model, torch.device("cpu"), rank=rank, world_size=world)
        assert checkpointed.policy.is_gradient_checkpointing
        policy, critic, _ = one_update(checkpointed, mine)
        if rank == 0:
            results["checkpointed"] = (policy, critic)
        del checkpointed

    # Host offload of the reference and of the trained models' state (FSDP2 CPU offload).
    if strategy == "fsdp" and world == 2:
        base = parallel_settings(folder, strategy)
        offload = {"offload_reference": True, "offload_optimizer": True}
        conf = base.model_copy(update={"parallel": base.parallel.model_copy(update=offload)})
        offloaded = Learner(conf, model, model, torch.device("cpu"), rank=rank, world_size=world)
        policy, critic, _ = one_update(offloaded, mine)
        if rank == 0:
            results["offloaded"] = (policy, critic)
        del offloaded

    # Host memory of a sharded load of a ~34M-parameter model: about this rank's shard.
    if big_model and strategy == "fsdp" and world == 2:
        spec = parallel.ShardSpec(parallel.make_mesh(torch.device("cpu")), torch.device("cpu"))
        stop, peak = threading.Event(), [0]
        with open("/proc/self/status") as status:
            base = next(int(x.split()[1]) * 1024 for x in status if x.startswith("RssAnon:"))
        sampler = threading.Thread(target=_peak_anonymous_memory, args=(stop, peak))
        sampler.start()
        big = load_causal_lm(conf.model, big_model, torch.device("cpu"), trainable=True, shard=spec)
        stop.set()
        sampler.join()
        full_bytes = sum(p.numel() * 4 for p in big.parameters())
        results["memory"] = (peak[0] - base, full_bytes)
        del big
    if rank == 0:
        torch.save(results, folder / f"results-{strategy}-{world}.pt")


class _Grads(torch.nn.Module):
    """The gradients of some parameters as a module state (for full_state_dict)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        super().__init__()
        for index, param in enumerate(params):
            self.register_buffer(f"g{index}", param.grad)


@pytest.fixture(scope="module")
def big_model_dir(tmp_path_factory) -> Path:
    from rlx.trainer.model.tiny import build_tiny_model

    folder = tmp_path_factory.mktemp("big") / "model"
    return build_tiny_model(folder, hidden_size=512, num_layers=8, num_heads=8)


# Each world size runs once, every strategy in the same process group.
LAYOUTS = {2: "fsdp,ddp", 3: "fsdp"}


@pytest.fixture(scope="module")
def ranks_ran() -> dict[int, bool]:
    """The world sizes whose ranks have run in this module (each on first use)."""
    return {}


def run_ranks(
    world: int, strategy: str, model: Path, unsharded: dict, big: Path, ran: dict
) -> dict:
    if world not in ran:
        fork_ranks(
            _rank,
            (world, LAYOUTS[world], str(model), str(big), str(unsharded["dir"])),
            world,
        )
        ran[world] = True
    return torch.load(unsharded["dir"] / f"results-{strategy}-{world}.pt", weights_only=False)


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.parametrize(("world", "strategy"), [(2, "fsdp"), (3, "fsdp"), (2, "ddp")])
def test_ranks_train_like_one_unsharded_process(
    world, strategy, tiny_model_dir, big_model_dir, unsharded, ranks_ran
) -> None:
    got = run_ranks(world, strategy, tiny_model_dir, unsharded, big_model_dir, ranks_ran)
    assert got["strategy"] == strategy
    assert got["load_diff"] == 0.0 and got["tied"]
    for name, want in unsharded["prepared"].items():
        torch.testing.assert_close(got["prepared"][name], want, rtol=1e-5, atol=1e-6)
    want = unsharded["metrics"]
    report = [f"{strategy} x{world}"]
    for name in ("loss/policy", "loss/kl", "loss/value", "entropy", "grad_norm"):
        difference = relative(got["metrics"][name], want[name])
        report.append(f"{name} {want[name]:.4g} ({difference:.1e})")
        assert difference <= LOSS_TOLERANCE, (name, got["metrics"][name], want[name])
    worst_policy = assert_same_gradients(got["policy"], unsharded["policy"], GRADIENT_TOLERANCE)
    worst_critic = assert_same_gradients(got["critic"], unsharded["critic"], GRADIENT_TOLERANCE)
    report.append(f"policy grads {worst_policy:.1e} critic grads {worst_critic:.1e}")

    norm, total, before, after = got["clip"]
    assert relative(norm, total) < 1e-6  # the norm over every shard, not one rank's
    for name, grad in before.items():
        torch.testing.assert_close(after[name], grad * 0.5, rtol=1e-5, atol=1e-9)

    counts, policy, critic = got["budget"]
    report.append(f"budget passes {counts}")
    assert len(set(counts)) > 1  # padding passes were needed, and changed nothing
    assert_same_gradients(policy, unsharded["policy"], GRADIENT_TOLERANCE)
    assert_same_gradients(critic, unsharded["critic"], GRADIENT_TOLERANCE)

    if strategy == "fsdp":
        expected = unsharded["generated"][: len(got["generated"])]
        for want_ids, got_ids in zip(expected, got["generated"], strict=True):
            assert torch.equal(got_ids, want_ids)
        assert abs(got["probe"] - unsharded["probe"]) < 1e-4

        buckets, pushed, whole, traffic = got["pushed"]
        # Every parameter, in order; the head tied to the embeddings travels once.
        assert buckets > 2
        assert [name for name, _ in pushed] == [n for n in whole if n != "lm_head.weight"]
        for name, tensor in pushed:
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor, whole[name].to(torch.bfloat16)), name
        # bf16 on the wire, whole tensors on rank 0 only: FSDP ranks send their own rows
        # (2 bytes each), rank 0 receives the rest and copies only its own.
        total = sum(tensor.numel() * 2 for _, tensor in pushed)
        if strategy == "fsdp":
            # FSDP2's rows of a tensor: ceil(rows / ranks) each, in rank order.
            share = [0] * world
            for _, tensor in pushed:
                per = -(-tensor.shape[0] // world)
                for r in range(world):
                    first = min(per * r, tensor.shape[0])
                    rows = max(min(per, tensor.shape[0] - first), 0)
                    share[r] += rows * tensor[0].numel() * 2
            assert traffic[0].copied == share[0] and traffic[0].received == total - share[0]
            assert [t.sent for t in traffic] == [0, *share[1:]], traffic
            assert all(t.received == 0 and t.copied == 0 for t in traffic[1:])
        else:  # every rank has the whole tensors: rank 0 copies them, nobody sends
            assert traffic[0].copied == total and all(t.sent == 0 for t in traffic)
        report.append(f"push traffic per rank (bytes): {[(t.sent, t.received) for t in traffic]}")

        for variant in ("checkpointed", "offloaded"):
            if variant in got:
                policy, critic = got[variant]
                assert_same_gradients(policy, unsharded["policy"], GRADIENT_TOLERANCE)
                assert_same_gradients(critic, unsharded["critic"], GRADIENT_TOLERANCE)
                report.append(variant)

    if "memory" in got:
        peak, full = got["memory"]
        report.append(f"load peak {peak / 2**20:.0f} MiB of {full / 2**20:.0f} MiB fp32")
        # Its shard (full / world) plus slack for one tensor in flight and the allocator.
        assert peak < full / world * 1.25 + 24 * 2**20, (peak, full)
    print("  ".join(report))


def test_chunked_logprobs_equal_the_full_logits(tiny_model_dir, ppo_step_batch) -> None:
    from transformers import AutoModelForCausalLM

    from rlx.trainer.learn.scoring import ResponseScorer, score_responses

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.train()
    batch = ppo_step_batch
    mask = batch.response_mask
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))

    def run(chunk: int | None) -> tuple[torch.Tensor, torch.Tensor, dict]:
        model.zero_grad()
        if chunk is None:  # the plain way: every logit at once, autograd through all
            width = mask.shape[1]
            logits = (
                model(
                    input_ids=batch.input_ids,
                    attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids,
                ).logits[:, -width - 1 : -1]
                / 0.7
            )  # (B, R, V)
            logp = torch.log_softmax(logits, -1).gather(-1, batch.response_ids[..., None])
            logp = torch.where(mask, logp.squeeze(-1), 0.0)
            probs = torch.softmax(logits, -1)
            entropy = torch.where(mask, -(probs * torch.log_softmax(logits, -1)).sum(-1), 0.0)
        else:
            scores = score_responses(
                ResponseScorer(model, chunk_tokens=chunk), batch, 0.7, entropy_grad=True
            )
            logp, entropy = scores.logprobs, scores.entropy
        ((logp + 0.3 * entropy) * weights).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        return logp.detach(), entropy.detach(), grads

    want_logp, want_entropy, want_grads = run(None)
    for chunk in (7, 1000):
        logp, entropy, grads = run(chunk)
        torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy, want_entropy, rtol=1e-5, atol=1e-5)
        assert_same_gradients(grads, want_grads, 1e-5)
    # Entropy without a graph when its coefficient is zero: same values, no gradient path.
    with torch.no_grad():
        plain = score_responses(
            ResponseScorer(model, chunk_tokens=7), batch, 0.7, entropy_grad=False
        )
    torch.testing.assert_close(plain.entropy, want_entropy, rtol=1e-5, atol=1e-5)
    scores = score_responses(ResponseScorer(model, chunk_tokens=7), batch, 0.7, entropy_grad=False)
    assert scores.logprobs.requires_grad and not scores.entropy.requires_grad


def test_token_budget_packs_rows_without_losing_any(ppo_step_batch) -> None:
    tokens = ppo_step_batch.attention_mask.sum(dim=1)
    rows = micro_batch_rows(ppo_step_batch, 2, 30)
    assert sorted(r for piece in rows for r in piece) == list(range(len(ppo_step_batch)))
    for piece in rows:
        assert len(piece) == 1 or int(tokens[piece].sum()) <= 30
    assert micro_batch_rows(ppo_step_batch, 5) == [
        list(range(s, min(s + 5, 12))) for s in (0, 5, 10)
    ]


def test_token_budget_gives_the_fixed_count_gradient(tmp_path, tiny_model_dir, unsharded) -> None:
    conf = ppo_settings(tmp_path, max_tokens_per_micro_batch=25)
    learner = Learner(conf, str(tiny_model_dir), str(tiny_model_dir), torch.device("cpu"))
    policy, critic, stats = one_update(learner, unsharded["batch"])
    assert_same_gradients(policy, unsharded["policy"], GRADIENT_TOLERANCE)
    assert_same_gradients(critic, unsharded["critic"], GRADIENT_TOLERANCE)
    metrics = merge_update_stats([stats])
    assert relative(metrics["loss/policy"], unsharded["metrics"]["loss/policy"]) < 1e-6


def test_reference_and_values_are_what_the_unsharded_process_prepared(unsharded) -> None:
    prepared = unsharded["prepared"]
    assert set(prepared) == {REF_LOGP, VALUES}
    assert torch.all(prepared[VALUES] == 0)  # the value head starts at zero


def _ddp_rank(rank: int, world: int, init_file: str, model: str, tmp: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    conf = small_trainer(Path(tmp), batch={"micro_batch_size": 3}, optim={"grad_clip": 1e9})
    learner = Learner(conf, model, None, torch.device("cpu"), rank=rank, world_size=world)
    batch = torch.load(os.path.join(tmp, "batch.pt"), weights_only=False)
    share = len(batch) // world
    gradient = gradient_of_update(learner, batch.select(range(rank * share, (rank + 1) * share)))
    if rank == 0:
        torch.save(gradient, out)
    dist.destroy_process_group()


def test_two_ddp_ranks_update_like_one(tmp_path, tiny_model_dir, advantage_batch):
    """Each rank gets half the minibatch; with the global token count and the world-size
    factor, DDP's averaged gradient equals the single-process one."""
    torch.save(advantage_batch, tmp_path / "batch.pt")
    conf = small_trainer(tmp_path, batch={"micro_batch_size": 3}, optim={"grad_clip": 1e9})
    single = Learner(conf, str(tiny_model_dir), None, torch.device("cpu"))
    want = gradient_of_update(single, advantage_batch)
    out = tmp_path / "ddp.pt"
    fork_ranks(
        _ddp_rank, (2, str(tmp_path / "init"), str(tiny_model_dir), str(tmp_path), str(out)), 2
    )
    assert_same_gradient(torch.load(out), want)
