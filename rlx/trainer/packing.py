"""Sequences packed end to end: no forward or backward spends compute on padding. A leaf:
torch only.

A packed row holds whole sequences (prompt + response, padding dropped) one after another;
its position ids restart at 0 for each, and it is run with no attention mask and no cache:
transformers then builds the block-diagonal causal mask itself from the position ids (SDPA
and eager attention) or hands the sequence starts to FlashAttention's varlen kernels, so a
token attends to its own sequence only and every log-prob equals that of the sequence run
alone. A 2-D attention mask or a KV cache silently defeats this (the sequences attend
across each other), so a packed forward never takes either (ResponseScorer, ValueModel).
Sequences that share a prompt can share it in a row too (`shared_segments`): the prompt once,
then each response; the position ids cannot say that a response sees the prompt but not its
siblings, so such rows carry their own 4-D mask (PackedRows.attention), which SDPA and eager
attention take as it is. Every row also says where its segments lie (PackedRows.layout): a
model that attends by segments (rlx.trainer.model.attention) reads that instead of any mask,
and then needs no mask at all.

How sequences are cut up: `pack_bins` puts sequences into rows of at most `row_tokens`
(a greedy balance, longest first); `plan_passes` groups rows into the passes (forward and
backward) of at most `budget` tokens; `balanced_split` gives each data-parallel rank the
same number of sequences and about the same cost, a*L + b*L^2 (the linear layers and the
attention), so that no rank waits for another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rlx.trainer.batch import SequenceBatch

# The dense block-diagonal mask of SDPA/eager grows with the square of a row: on those paths
# rows are cut (longer sequences get a row of their own) and a pass stacks several rows.
# 512 tokens was fastest at hidden size 256 (bench/packing.py); the cut grows with the
# hidden size (masked_row_tokens). FlashAttention's varlen kernels and segment attention
# cost nothing for a mask: one row per pass.
MASKED_ROW_TOKENS = 512
MASKED_ROW_HIDDEN = 256
# Row counts pack_bins weighs (from the fewest that can fit): one more row can make them all
# narrower, and a pass as wide as its fullest row wastes less.
ROW_COUNTS_TRIED = 4

# A segment as a row places it: (start, prompt, responses), `prompt` tokens from `start`
# then each response's tokens (a sequence packed alone: its prompt and its one response).
Segment = tuple[int, int, tuple[int, ...]]
Layout = tuple[tuple[Segment, ...], ...]  # each row's segments, in order


def masked_row_tokens(hidden_size: int) -> int:
    """Where rows are cut with a dense mask: MASKED_ROW_TOKENS at MASKED_ROW_HIDDEN, a whole
    multiple of it as the hidden size grows. Attention over a row of L tokens costs about
    L / (6 H) of its linear layers (attention_weight): a wider model pays relatively less for
    a long row and more for the padding that shorter rows leave."""
    return MASKED_ROW_TOKENS * max(1, hidden_size // MASKED_ROW_HIDDEN)


def sequence_lengths(batch: SequenceBatch) -> list[int]:
    """Real (prompt + response) tokens of each row."""
    return batch.attention_mask.sum(dim=1).tolist()


def sequence_cost(length: int, attention_weight: float) -> float:
    """What a sequence of `length` tokens costs in a forward: a*L for the linear layers plus
    b*L^2 for attention (b/a = attention_weight)."""
    return length + attention_weight * length * length


def attention_weight(hidden_size: int) -> float:
    """b/a of sequence_cost for a decoder: attention's scores and weighted sum take about 4*H
    flops per pair of tokens per layer, its projections and the MLP about 24*H^2 per token."""
    return 4.0 / (24.0 * max(hidden_size, 1))


def _balanced_rows(lengths: Sequence[int], order: Sequence[int], count: int) -> list[list[int]]:
    """`count` rows, each sequence (longest first) joining the row that holds fewest tokens."""
    rows: list[list[int]] = [[] for _ in range(count)]
    held = [0] * count
    for index in order:
        slot = min(range(count), key=lambda r: (held[r], r))
        rows[slot].append(index)
        held[slot] += lengths[index]
    return [row for row in rows if row]


def pack_bins(lengths: Sequence[int], row_tokens: int) -> list[list[int]]:
    """Indices of `lengths` put into rows of at most row_tokens tokens by a greedy balance:
    for k rows, each sequence, longest first, joins the row holding fewest tokens. Of the
    first few k whose fullest row fits (from the fewest rows the tokens need), the one
    computing the fewest positions (k x its fullest row: rows stacked in one pass are as
    wide as the fullest) is taken. A sequence longer than row_tokens ends up in a row of
    its own. Rows come fullest first."""
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    cap = max(row_tokens, max(lengths))
    count = max(1, -(-sum(lengths) // max(row_tokens, 1)))
    best: tuple[int, int, list[list[int]]] | None = None
    tried = 0
    while count <= len(lengths) and tried < ROW_COUNTS_TRIED:
        rows = _balanced_rows(lengths, order, count)
        fullest = max(sum(lengths[i] for i in row) for row in rows)
        if fullest <= cap:
            tried += 1
            positions = len(rows) * fullest
            if best is None or positions < best[0]:
                best = (positions, count, rows)
        count += 1
    if best is None:  # only reached with count == len(lengths): a row each
        return sorted(([i] for i in range(len(lengths))), key=lambda row: -lengths[row[0]])
    rows = best[2]
    fills = [sum(lengths[i] for i in row) for row in rows]
    return [rows[r] for r in sorted(range(len(rows)), key=lambda r: (-fills[r], r))]


def plan_passes(lengths: Sequence[int], budget: int, row_tokens: int) -> list[list[list[int]]]:
    """The passes over a batch: each a list of rows, each row the sequences packed in it,
    with at most `budget` tokens in all (rows stack to the width of the longest; a sequence
    longer than the budget goes alone). row_tokens caps a row (min with the budget)."""
    width = max(1, min(row_tokens, budget))
    rows = pack_bins(lengths, width)
    passes: list[list[list[int]]] = []
    for row in rows:  # fullest first: rows of a pass have about the same width
        tokens = sum(lengths[i] for i in row)
        if passes:
            held = passes[-1]
            widest = max(tokens, max(sum(lengths[i] for i in r) for r in held))
            if widest * (len(held) + 1) <= budget:
                held.append(row)
                continue
        passes.append([row])
    return passes


def balanced_split(costs: Sequence[float], parts: int) -> list[list[int]]:
    """Indices of `costs` in `parts` groups whose sizes differ by at most one (the first ones
    get the extra items, as split_evenly), the largest cost going first to the least loaded
    group that still has room: no rank waits long for another."""
    count = len(costs)
    base, extra = divmod(count, parts)
    room = [base + (1 if part < extra else 0) for part in range(parts)]
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [0.0] * parts
    for index in sorted(range(count), key=lambda i: (-costs[i], i)):
        part = min((p for p in range(parts) if room[p] > 0), key=lambda p: (load[p], p))
        groups[part].append(index)
        load[part] += costs[index]
        room[part] -= 1
    return [sorted(group) for group in groups]


def shared_segments(
    lengths: Sequence[int],
    prompt_lengths: Sequence[int],
    prompt_of: Sequence[int],
    row_tokens: int,
) -> list[list[int]]:
    """Sequences that hold the same prompt (prompt_of: a prompt's id per sequence) gathered
    into segments that run their prompt once, each response after it: a segment costs its
    prompt plus its responses. A prompt's responses, longest first, go to the first of its
    segments with room (row_tokens), else start a new one (a response too long for any
    segment has one of its own). Segments come in order of their prompts' first sequence."""
    members: dict[int, list[int]] = {}
    for index, prompt in enumerate(prompt_of):
        members.setdefault(prompt, []).append(index)
    segments: list[list[int]] = []
    for indices in members.values():
        prompt = prompt_lengths[indices[0]]
        own: list[list[int]] = []
        held: list[int] = []
        for index in sorted(indices, key=lambda i: (-lengths[i], i)):
            response = lengths[index] - prompt
            slot = next((s for s, h in enumerate(held) if h + response <= row_tokens), None)
            if slot is None:
                own.append([index])
                held.append(prompt + response)
            else:
                own[slot].append(index)
                held[slot] += response
        segments.extend(sorted(segment) for segment in own)
    return segments


def segment_lengths(
    segments: Sequence[Sequence[int]], lengths: Sequence[int], prompt_lengths: Sequence[int]
) -> list[int]:
    """Tokens each segment places: its prompt once and every response."""
    return [
        prompt_lengths[segment[0]] + sum(lengths[i] - prompt_lengths[i] for i in segment)
        for segment in segments
    ]


@dataclass(frozen=True)
class PackedRows:
    """A pass's sequences packed into rows, as the model takes them.

    input_ids, position_ids: (k, T); a row's tail beyond its sequences is padding with
    positions of its own (0, 1, ...), a segment no real token attends to. score_index: (N,)
    flat indices into the k*T positions, the one whose output predicts each scored response
    token (response_mask's True entries, row-major: the order masked_scatter fills).
    attention: None when every segment is one sequence (the model derives the block-diagonal
    mask from the position ids); with segments that share a prompt, (k, 1, T, T) True where
    a position attends: its own segment's prompt and its own response, causally. Padding
    attends to itself alone.
    """

    input_ids: Tensor  # (k, T) long
    position_ids: Tensor  # (k, T) long
    score_index: Tensor  # (N,) long
    real_tokens: int
    attention: Tensor | None = None  # (k, 1, T, T) bool
    # (N,) flat index of each scored token itself; None: the position after score_index's
    # (a segment's first tokens of its responses all follow its prompt's last position)
    target_index: Tensor | None = None
    # Per row, its segments in order: what a model that attends by segments reads instead
    # of a mask (rlx.trainer.model.attention).
    layout: Layout = ()

    def target_positions(self) -> Tensor:
        """(N,) flat index of each scored response token in input_ids."""
        return self.score_index + 1 if self.target_index is None else self.target_index

    @property
    def positions(self) -> int:
        """Positions the forward computes, padding included."""
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> PackedRows:
        return PackedRows(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            score_index=self.score_index.to(device),
            real_tokens=self.real_tokens,
            attention=None if self.attention is None else self.attention.to(device),
            target_index=None if self.target_index is None else self.target_index.to(device),
            layout=self.layout,
        )


def _segments_placing_every_row(
    rows: Sequence[Sequence[int | Sequence[int]]], count: int
) -> list[list[list[int]]]:
    """Each row as its segments (a sequence alone: a segment of one); ValueError unless
    they place each of the batch's `count` sequences exactly once."""
    row_segments = [[[i] if isinstance(i, int) else list(i) for i in row] for row in rows]
    placed = sorted(i for row in row_segments for segment in row for i in segment)
    if placed != list(range(count)):
        raise ValueError(f"the rows place sequences {placed}, the batch holds {count}")
    return row_segments


def _check_shared_prompt(
    segment: list[int], prompt: int, tokens: list[torch.Tensor], prompt_lengths: list[int]
) -> None:
    """ValueError unless the segment's sequences have its first one's prompt."""
    for i in segment:
        if prompt_lengths[i] != prompt or not torch.equal(
            tokens[i][:prompt], tokens[segment[0]][:prompt]
        ):
            raise ValueError(f"sequences {segment} share a segment but not a prompt")


def _score_indices(
    batch: SequenceBatch, prompt_last: list[int], response_first: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the flat packed position whose logits score each response token, the flat position
    of the token itself), (N,) each, in the batch's row-major order of response tokens."""
    scored = batch.response_mask.nonzero()  # (N, 2) row-major: (sequence, response column)
    sequence, column = scored[:, 0], scored[:, 1]
    # Response token 0 is predicted by the prompt's last position, token t by token t - 1.
    target_index = torch.tensor(response_first, dtype=torch.long)[sequence] + column  # (N,)
    score_index = torch.where(
        column == 0, torch.tensor(prompt_last, dtype=torch.long)[sequence], target_index - 1
    )  # (N,)
    return score_index, target_index


def _shared_prompt_mask(
    segment_of: torch.Tensor, position_ids: torch.Tensor, branch_of: torch.Tensor
) -> torch.Tensor:
    """(k, 1, T, T) bool: a position attends to the earlier positions of its segment that
    are its shared prompt (branch 0) or its own response."""
    query, key = (slice(None), slice(None), None), (slice(None), None, slice(None))
    return (
        (segment_of[query] == segment_of[key])
        & (position_ids[key] <= position_ids[query])
        & ((branch_of[key] == 0) | (branch_of[key] == branch_of[query]))
    ).unsqueeze(1)  # (k, 1, T, T)


def pack_rows(
    batch: SequenceBatch,
    rows: Sequence[Sequence[int | Sequence[int]]],
    pad_token_id: int = 0,
    *,
    masks: bool = True,
) -> PackedRows:
    """`batch`'s sequences (every row of it, each in exactly one place of `rows`) packed as
    given. A row holds sequences (an index) or segments (a list of indices of sequences
    with the same prompt, run once with each response after it; see shared_segments). Each
    sequence's real tokens are its attention mask's ones: a left-padded prompt then a
    right-padded response, contiguous. masks=False: no 4-D mask for rows that share
    prompts (every model reading them attends by the layout)."""
    row_segments = _segments_placing_every_row(rows, len(batch))
    real = batch.attention_mask.bool()  # (B, P + R)
    lengths = real.sum(dim=1).tolist()  # (B,)
    prompt_lengths = real[:, : batch.prompt_width].sum(dim=1).tolist()  # (B,)
    tokens = [batch.input_ids[i][real[i]] for i in range(len(batch))]  # each (L_i,)
    shares = any(len(segment) > 1 for row in row_segments for segment in row)
    fills = [segment_lengths(row, lengths, prompt_lengths) for row in row_segments]
    width = max(sum(fill) for fill in fills)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)  # (k, T)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)  # (k, T)
    # Per position: its segment (padding: one each) and branch (0 prompt, j + 1 response j).
    segment_of = torch.zeros((len(rows), width), dtype=torch.long)  # (k, T)
    branch_of = torch.zeros((len(rows), width), dtype=torch.long)  # (k, T)
    prompt_last = [0] * len(batch)  # flat index of each sequence's last prompt token
    response_first = [0] * len(batch)  # flat index of its first response token
    label = 0
    layout: list[tuple[Segment, ...]] = []
    for r, row in enumerate(row_segments):
        offset = 0
        placed_here: list[Segment] = []
        for segment in row:
            label += 1
            prompt = prompt_lengths[segment[0]]
            placed_here.append((offset, prompt, tuple(lengths[i] - prompt for i in segment)))
            _check_shared_prompt(segment, prompt, tokens, prompt_lengths)
            input_ids[r, offset : offset + prompt] = tokens[segment[0]][:prompt]
            position_ids[r, offset : offset + prompt] = torch.arange(prompt)
            segment_of[r, offset : offset + prompt] = label
            start = offset
            offset += prompt
            for branch, i in enumerate(segment, start=1):
                response = lengths[i] - prompt
                input_ids[r, offset : offset + response] = tokens[i][prompt:]
                position_ids[r, offset : offset + response] = torch.arange(
                    prompt, prompt + response
                )
                segment_of[r, offset : offset + response] = label
                branch_of[r, offset : offset + response] = branch
                prompt_last[i] = r * width + start + prompt - 1
                response_first[i] = r * width + offset
                offset += response
        layout.append(tuple(placed_here))
        tail = width - offset
        position_ids[r, offset:] = torch.arange(tail)
        segment_of[r, offset:] = -torch.arange(1, tail + 1)  # padding: a segment each
    score_index, target_index = _score_indices(batch, prompt_last, response_first)
    attention = None
    if shares and masks:
        attention = _shared_prompt_mask(segment_of, position_ids, branch_of)
    return PackedRows(
        input_ids,
        position_ids,
        score_index,
        real_tokens=sum(sum(fill) for fill in fills),
        attention=attention,
        target_index=target_index,
        layout=tuple(layout),
    )
