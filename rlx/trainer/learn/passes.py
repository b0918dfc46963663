"""How a learner's batch becomes forward/backward passes (PassPlanner): packed or padded,
which rows go together, and the run's one decision about packing, made when the models are
loaded and confirmed on the first batch (sequences packed must score as they do alone).

Packed passes (rlx.trainer.packing) hold whole sequences end to end in rows of at most
row_tokens, rows in passes of at most the packed-pass budget; padded passes are
micro-batches of micro_batch_size rows or max_tokens_per_micro_batch tokens. With several
ranks every rank makes as many passes as the busiest one (FSDP's forwards and DDP's buffer
broadcasts are collectives).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rlx.plan.budget import packed_pass_tokens
from rlx.recipe.model import TrainerSettings
from rlx.trainer import packing as pack
from rlx.trainer.batch import SequenceBatch, micro_batch_rows
from rlx.trainer.learn import sharding
from rlx.trainer.model.prefill import prompt_groups
from rlx.trainer.model.traits import traits


@dataclass(frozen=True)
class Pass:
    """One forward/backward: rows of the batch, whether it counts (see PassPlanner.passes)
    and, packed, how those rows (indices into `rows`) share packed rows."""

    rows: list[int]
    counts: bool
    packed: list[list[list[int]]] | None = None  # rows of segments (see pack.pack_rows)


# What the first-batch check compares: a name for its line ("log-probs", "values") and a
# function of a micro-batch on the device, and optionally the same sequences packed, to
# its (b, r) per-token results.
Measure = tuple[str, Callable[[SequenceBatch, pack.PackedRows | None], Tensor]]


def packing_tolerance(dtype: torch.dtype, scale: float) -> float:
    """The largest mean difference of log-probs between a packed row and its sequences run
    alone that is rounding, not sequences attending to each other: a few units of the
    dtype's resolution at the log-probs' size (contamination moves them by tenths)."""
    return 8 * torch.finfo(dtype).eps * (1.0 + scale)


class PassPlanner:
    """The passes of one rank's learner, for the whole run.

    Handed the settings, the loaded models (policy, and the reference and critic where the
    run has them), the device and compute dtype, and whether the ranks must agree (several
    ranks sharing the models). Decides once whether the passes are packed (`packing`, and
    `note`, the line that says so) and how: `by_segments` (packed rows attend by their
    layout, one row a pass: the caller switches the models to segment attention),
    `share_prompts` (a row runs a prompt once for its responses), `row_tokens` (the widest
    packed row) and `attention_weight` (what a sequence's length costs, for balancing ranks).
    """

    def __init__(
        self,
        settings: TrainerSettings,
        policy: nn.Module,
        reference: nn.Module | None,
        critic: nn.Module | None,
        *,
        device: torch.device,
        dtype: torch.dtype,
        across_ranks: bool,
    ):
        self.settings = settings
        self.policy = policy
        self.has_critic = critic is not None
        self.device, self.dtype = device, dtype
        self.across_ranks = across_ranks
        models = [m for m in (policy, reference, critic) if m is not None]
        varlen = traits(policy).varlen
        # Packed rows run a prompt once for the responses that share it (a layout or a 4-D
        # mask), where every model's attention takes one; FlashAttention's varlen kernels
        # cannot. On CPU, where every model runs SDPA over full attention, packed passes
        # attend by their layout (attention.py): no dense mask, so a pass is one row. Not
        # on GPUs: there each response's attention is a few kernel launches of its own, a
        # cost not yet measured against the dense mask's (FlashAttention's varlen is the
        # GPU's way to skip it).
        facts = [traits(m) for m in models]
        by_segments = device.type == "cpu" and all(f.can_attend_by_segments for f in facts)
        self.share_prompts = all(f.shares_packed_prompts for f in facts)
        self.packing, self.note = self._decide(models, varlen=varlen, by_segments=by_segments)
        self.by_segments = by_segments and self.packing
        self.checked = False
        hidden = getattr(policy.config, "hidden_size", 1)  # type: ignore[union-attr]
        whole = varlen or self.by_segments
        self.row_tokens = self.budget if whole else pack.masked_row_tokens(hidden)
        self.attention_weight = pack.attention_weight(hidden)

    @property
    def budget(self) -> int:
        """The most tokens a packed pass holds."""
        return packed_pass_tokens(self.settings)

    def _decide(
        self, models: Sequence[nn.Module], *, varlen: bool, by_segments: bool
    ) -> tuple[bool, str]:
        """Whether the passes are packed, and the line that says so. trainer.batch.packing
        unset: packed wherever every model's attention keeps packed sequences apart."""
        wanted = self.settings.batch.packing
        if wanted is False:
            return False, "packing: off (trainer.batch.packing: false); padded micro-batches"
        for model in models:
            obstacle = traits(model).packing_obstacle
            if obstacle is not None:
                return False, f"packing: off, {obstacle}; padded micro-batches instead"
        path = (
            "FlashAttention varlen"
            if varlen
            else "segment attention, a prompt once for its responses"
            if by_segments
            else "a prompt once for its responses, prompt-and-own-response masks"
            if self.share_prompts
            else "block-diagonal causal mask from restarting position ids"
        )
        when = (
            ""
            if wanted or self.has_critic
            else " for the batches where it computes less than padded passes that run a shared "
            "prompt once"
        )
        return True, (
            f"packing: on{when}, up to {self.budget} tokens a pass ({path}); checked "
            "against sequences run alone on the first step"
        )

    # ------------------------------------------------------------------ a batch's passes

    def passes(self, batch: SequenceBatch) -> list[Pass]:
        """The forward/backward passes over a batch, packed where the run packs and the
        batch's packed passes pay. With several ranks the extra passes that make every
        rank's count the busiest one's repeat the first and count for nothing (counts False:
        outputs dropped, loss x 0)."""
        batch_settings = self.settings.batch
        pieces = micro_batch_rows(
            batch, batch_settings.micro_batch_size, batch_settings.max_tokens_per_micro_batch
        )
        passes = [Pass(rows=piece, counts=True) for piece in pieces]
        if self.packing:
            segments, lengths = self.segments(batch)
            packed = []
            positions = 0  # what the packed passes compute: rows as wide as their fullest
            for rows in pack.plan_passes(lengths, self.budget, self.row_tokens):
                placed = [[segments[s] for s in row] for row in rows]
                flat = [i for row in placed for segment in row for i in segment]
                packed.append(Pass(flat, True, _local_rows(flat, placed)))
                positions += len(rows) * max(sum(lengths[s] for s in row) for row in rows)
            if self._packing_pays(batch, positions, passes):
                passes = packed
        if self.across_ranks:
            needed = sharding.most_over_ranks(len(passes), self.device)
            first = passes[0]
            passes += [Pass(first.rows, False, first.packed)] * (needed - len(passes))
        return passes

    def segments(self, batch: SequenceBatch) -> tuple[list[list[int]], list[int]]:
        """What packed rows hold: a sequence each, or where prompts are shared the segments
        of a prompt and its responses (pack.shared_segments); and the tokens each places."""
        lengths = pack.sequence_lengths(batch)
        groups = None
        if self.share_prompts and batch.prompt_width > 0:
            width = batch.prompt_width
            groups = prompt_groups(batch.input_ids[:, :width], batch.attention_mask[:, :width])
        if groups is None:
            return [[i] for i in range(len(batch))], lengths
        prompt_lengths = batch.attention_mask[:, : batch.prompt_width].sum(dim=1).tolist()
        segments = pack.shared_segments(
            lengths, prompt_lengths, groups[1].tolist(), self.row_tokens
        )
        return segments, pack.segment_lengths(segments, lengths, prompt_lengths)

    def _packing_pays(
        self, batch: SequenceBatch, packed_positions: int, padded: list[Pass]
    ) -> bool:
        """Whether the packed passes compute (packed_positions) fewer positions than the
        padded ones. Padded passes run a prompt shared by several rows once (GRPO's n samples;
        the policy's scorer, not the critic); packed rows do too where every model takes
        their mask (share_prompts), else each sequence carries its own copy, which can cost
        more when responses are short next to their prompts. Every rank decides alike (the
        two paths make different collective forwards under FSDP). trainer.batch.packing: true
        packs whatever the cost."""
        if self.settings.batch.packing or self.has_critic:
            wins = True  # asked for; or a critic, which shares no prompts padded
        else:
            padded_cost = sum(self.padded_cost(batch.select(one.rows))[0] for one in padded)
            wins = packed_positions <= padded_cost
        if self.across_ranks:
            wins = sharding.all_ranks(wins, self.device)
        return wins

    def padded_cost(self, mb: SequenceBatch) -> tuple[int, int]:
        """(positions computed, real tokens among them) of a padded pass over mb's rows,
        trimmed, its prompts run once per distinct prompt where the policy's scorer shares
        them (ResponseScorer)."""
        mb = mb.trimmed()
        width = mb.prompt_width
        responses = mb.response_mask.shape[1]
        groups = None
        if width > 0 and responses > 1 and traits(self.policy).shares_prefill(self.policy.training):
            groups = prompt_groups(mb.input_ids[:, :width], mb.attention_mask[:, :width])
        if groups is None:
            return mb.input_ids.numel(), mb.num_tokens
        first, _ = groups
        real = int(mb.attention_mask[first, :width].sum()) + int(mb.attention_mask[:, width:].sum())
        return len(first) * width + len(mb) * responses, real

    def pass_inputs(
        self, batch: SequenceBatch, one: Pass
    ) -> tuple[SequenceBatch, pack.PackedRows | None]:
        """A pass's rows on the device: trimmed of padding, and packed where the pass is."""
        mb = batch.select(one.rows).trimmed()
        packed = None
        if one.packed is not None:
            packed = pack.pack_rows(mb, one.packed, masks=not self.by_segments).to(self.device)
        return mb.to(self.device), packed

    # ------------------------------------------------------------------ the first-batch check

    @property
    def needs_check(self) -> bool:
        return self.packing and not self.checked

    def check(
        self,
        batch: SequenceBatch,
        measures: Sequence[Measure],
        quiet: Callable[[], AbstractContextManager[None]],
    ) -> str | None:
        """Once, on the first batch: two of its sequences packed in one row must measure as
        each does alone (each of `measures`, run under `quiet()`), within rounding; if not,
        packing is off from here on and the line that says so is returned. Every rank runs
        the same three forwards per measure (a rank with one sequence packs it twice)."""
        self.checked = True
        pair = batch.select([0, min(1, len(batch) - 1)]).trimmed()
        segments, _ = self.segments(pair)  # the two share their prompt where they can
        packed = pack.pack_rows(pair, [segments], masks=not self.by_segments).to(self.device)
        worst: tuple[float, str, float, float] = (0.0, "", 0.0, 0.0)  # gap/tolerance, ...
        with quiet():
            for what, measure in measures:
                together = measure(pair.to(self.device), packed).float().cpu()  # (2, r)
                for row in range(2):
                    single = pair.select([row]).trimmed()
                    own = measure(single.to(self.device), None).float().cpu()[0]  # (r',)
                    mask = single.response_mask[0]
                    got = together[row, : own.shape[0]]
                    scale = float(own[mask].abs().mean()) if bool(mask.any()) else 0.0
                    tolerance = packing_tolerance(self.dtype, scale)
                    gap = mean_gap(got, own, mask)
                    worst = max(worst, (gap / tolerance, what, gap, tolerance))
        exact = worst[0] <= 1.0
        if self.across_ranks:
            exact = sharding.all_ranks(exact, self.device)
        if exact:
            return None
        self.packing = False
        _, what, gap, tolerance = worst
        return (
            f"packing: off, a packed row's {what} differ from its sequences' run alone by "
            f"{gap:.2e} on average (rounding allows {tolerance:.1e}); padded micro-batches "
            "from here on"
        )


def _local_rows(rows: list[int], packed: list[list[list[int]]]) -> list[list[list[int]]]:
    """Packed rows (of segments) of batch indices as indices into `rows` (the pass's own
    order)."""
    where = {index: position for position, index in enumerate(rows)}
    return [[[where[index] for index in segment] for segment in row] for row in packed]


def mean_gap(got: Tensor, want: Tensor, mask: Tensor) -> float:
    """Mean |got - want| over the mask's positions (0 with none)."""
    if not bool(mask.any()):
        return 0.0
    return float((got - want).abs()[mask].mean())
