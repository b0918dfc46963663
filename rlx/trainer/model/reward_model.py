"""A reward model's scores, in packed, token-budgeted passes.

A reward model is a decoder with a one-label sequence-classification head (transformers'
`AutoModelForSequenceClassification`, as LlamaForSequenceClassification or
Qwen2ForSequenceClassification: a causal body and a `score` projection): its score for a
sequence is the head's output at the sequence's last token. transformers reads it at the
rightmost token that is not the pad token; a sequence scored here loses its trailing pad
tokens first (keeping one token at least), which is the same position.

Sequences are never run as one padded batch: that costs every sequence the longest one's
length, and its attention grows with the square of the longest times the count, which is
where a step of long completions runs out of memory. They are packed instead
(rlx.trainer.packing: whole sequences end to end, position ids restarting at each) into
passes of at most `token_budget` tokens, longest first, and each pass attends by its layout
(segment attention, rlx.trainer.model.attention) where the model can, else by the
block-diagonal mask transformers derives from the restarting position ids; the body's last
hidden state is read at each sequence's last position and the score head applied there. A
sequence longer than the budget runs in a pass of its own (a reward for a long completion
is worth more than a failed step): memory is bounded by the larger of the budget and the
longest sequence, which the reward model's context bounds in turn.

Two ways in: token ids (score_token_ids), where the reward model reads the policy's tokens
as they are (shares_tokenizer: the same vocabulary, every token the same id); or
conversations (score_conversations), rendered with the reward model's own chat template and
tokenizer, where it does not.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlx import hub
from rlx.errors import RlxError
from rlx.trainer import packing as pack
from rlx.trainer.batch import SequenceBatch
from rlx.trainer.model.attention import layout_inputs, use_segment_attention
from rlx.trainer.model.traits import traits

DEFAULT_TOKEN_BUDGET = 4096
CLASSIFIER_SUFFIX = "ForSequenceClassification"
SCORE_HEAD = "score"


def classifier_problem(config: Mapping[str, Any]) -> str | None:
    """Why a model folder's config.json (as a dict) is not a reward model rlx scores with, or
    None: a sequence classifier with exactly one label."""
    architectures = list(config.get("architectures") or [])
    if not architectures:
        return "names no architecture in its config.json"
    if not any(arch.endswith(CLASSIFIER_SUFFIX) for arch in architectures):
        return (
            f"is a {architectures[0]}, not a sequence classifier; a reward model is an "
            f"AutoModelForSequenceClassification with one label"
        )
    labels = config.get("num_labels")
    if labels is None:
        labels = len(config.get("id2label") or {}) or 2  # transformers' default: 2
    if labels != 1:
        return f"is a sequence classifier with {labels} labels; a reward model has one"
    return None


def reward_model_folder(spec: str, field: str = "trainer.rewards.model") -> Path:
    """The local folder of a reward model: a hub id's snapshot (rlx.hub, as every model),
    or a folder. One RlxError naming `field` otherwise, or when the folder does not hold a
    one-label sequence classifier."""
    if hub.is_hub_id(spec):
        folder = hub.snapshot(spec, field=field)
    else:
        folder = Path(spec).expanduser()
        if not folder.is_dir():
            raise RlxError(f"{field}: {spec} is not a folder nor a hub id (org/name)")
    config = folder / "config.json"
    if not config.is_file():
        raise RlxError(f"{field}: {spec} has no config.json; it is not a transformers model")
    problem = classifier_problem(json.loads(config.read_text()))
    if problem is not None:
        raise RlxError(f"{field}: {spec} {problem}")
    return folder


def last_real_length(ids: Sequence[int], pad_token_id: int | None) -> int:
    """How many of `ids` the score reads: up to the last token that is not the pad token
    (transformers' classifier pooling), at least one."""
    length = len(ids)
    if pad_token_id is not None:
        while length > 1 and ids[length - 1] == pad_token_id:
            length -= 1
    return length


class RewardModelScorer:
    """A one-label reward model loaded once, scoring lists of sequences.

    spec: a hub id or a folder (reward_model_folder). token_budget: the most tokens one
    forward holds. dtype, device: where it computes (float32 on CPU by default; bf16 on a
    GPU is the usual choice there). field: the recipe field named in its errors.
    """

    def __init__(
        self,
        spec: str,
        *,
        token_budget: int = DEFAULT_TOKEN_BUDGET,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        field: str = "trainer.rewards.model",
        trust_remote_code: bool = False,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if token_budget < 1:
            raise ValueError(f"token_budget must be at least 1, not {token_budget}")
        self.folder = reward_model_folder(spec, field)
        self.token_budget = token_budget
        self.device = torch.device(device)
        model = AutoModelForSequenceClassification.from_pretrained(
            self.folder,
            dtype=dtype,
            attn_implementation="sdpa",
            trust_remote_code=trust_remote_code,
        )
        body = getattr(model, getattr(model, "base_model_prefix", ""), None)
        head = getattr(model, SCORE_HEAD, None)
        if not isinstance(body, nn.Module) or not isinstance(head, nn.Linear):
            raise RlxError(
                f"{field}: {spec} is a {type(model).__name__}; rlx scores with decoder reward "
                f"models (a causal body and a linear `{SCORE_HEAD}` head, as "
                "LlamaForSequenceClassification)"
            )
        obstacle = traits(body).packing_obstacle
        if obstacle is not None:
            raise RlxError(f"{field}: {spec} cannot be scored in packed passes: {obstacle}")
        self.by_segments = traits(body).can_attend_by_segments
        if self.by_segments:
            use_segment_attention(body)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.body, self.head = body, head
        self.pad_token_id = model.config.get_text_config().pad_token_id
        self.max_length = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.tokenizer = AutoTokenizer.from_pretrained(
            self.folder, trust_remote_code=trust_remote_code
        )
        facts = traits(body)
        hidden = getattr(model.config.get_text_config(), "hidden_size", 1)
        # Segment attention and FlashAttention's varlen kernels need no mask: one row a
        # pass. A dense block-diagonal mask grows with a row's square: rows are cut.
        whole = self.by_segments or facts.varlen
        self.row_tokens = token_budget if whole else pack.masked_row_tokens(hidden)
        # Positions (padding too) of each forward of the last score_token_ids call.
        self.forwards: list[int] = []

    # ------------------------------------------------------------------ the ways in

    def shares_tokenizer(self, policy_tokenizer: Any) -> bool:
        """Whether the policy's token ids mean to this reward model what they mean to the
        policy: the same vocabulary, every token (added and special ones too) the same id."""
        try:
            return dict(policy_tokenizer.get_vocab()) == dict(self.tokenizer.get_vocab())
        except (AttributeError, TypeError):
            return False

    def score_conversations(
        self, conversations: Sequence[Sequence[Mapping[str, Any]]]
    ) -> list[float]:
        """Scores of conversations (lists of {"role", "content"} messages, the response the
        last), each rendered with the reward model's own chat template and tokenizer."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise RlxError(
                f"the reward model {self.folder} has no chat template, so conversations "
                "cannot be rendered for it; use one that shares the policy's tokenizer or "
                "give its tokenizer a chat_template"
            )
        return self.score_token_ids([self.render(c) for c in conversations])

    def render(self, conversation: Sequence[Mapping[str, Any]]) -> list[int]:
        """A conversation's token ids as the reward model reads it: its chat template's text
        (the template writes any special tokens itself), tokenized without adding more."""
        text = self.tokenizer.apply_chat_template(
            [dict(message) for message in conversation], tokenize=False
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @torch.inference_mode()
    def score_token_ids(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """One score per sequence of token ids, in the order given, from packed passes of
        at most token_budget tokens (a longer sequence alone in its pass)."""
        self.forwards = []
        trimmed = [list(ids[: last_real_length(ids, self.pad_token_id)]) for ids in sequences]
        for index, ids in enumerate(trimmed):
            if not ids:
                raise ValueError(f"sequence {index} is empty: there is nothing to score")
            if self.max_length is not None and len(ids) > self.max_length:
                raise RlxError(
                    f"a sequence of {len(ids)} tokens is longer than the reward model "
                    f"{self.folder} reads ({self.max_length} positions); cap the responses "
                    "(max_new_tokens) or use a reward model with a longer context"
                )
        scores = [0.0] * len(trimmed)
        lengths = [len(ids) for ids in trimmed]
        for rows in pack.plan_passes(lengths, self.token_budget, self.row_tokens):
            members = [i for row in rows for i in row]
            local = {index: place for place, index in enumerate(members)}
            batch = as_prompts([trimmed[i] for i in members])
            packed = pack.pack_rows(
                batch, [[local[i] for i in row] for row in rows], masks=False
            ).to(self.device)
            for index, score in zip(members, self._forward(packed), strict=True):
                scores[index] = score
        return scores

    # ------------------------------------------------------------------ the forward

    def _forward(self, packed: pack.PackedRows) -> list[float]:
        """Scores of a pass's sequences, in the order its rows place them."""
        self.forwards.append(packed.positions)
        if self.by_segments:
            inputs = layout_inputs(packed.layout, self.device)
        else:  # transformers derives the block-diagonal mask from the position ids
            inputs = {"attention_mask": None}
        hidden = self.body(
            input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False, **inputs
        ).last_hidden_state  # (k, T, H)
        width = packed.input_ids.shape[1]
        last = [
            r * width + start + prompt + sum(responses) - 1
            for r, segments in enumerate(packed.layout)
            for start, prompt, responses in segments
        ]  # flat index of each sequence's last token, in placing order
        index = torch.tensor(last, dtype=torch.long, device=hidden.device)  # (N,)
        picked = hidden.reshape(-1, hidden.shape[-1])[index]  # (N, H)
        return self.head(picked.to(self.head.weight.dtype)).squeeze(-1).float().tolist()


def as_prompts(sequences: Sequence[Sequence[int]]) -> SequenceBatch:
    """Whole sequences as a batch of left-padded prompts without responses: what pack_rows
    places as segments of one sequence each."""
    width = max(len(ids) for ids in sequences)
    input_ids = torch.zeros((len(sequences), width), dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)  # (B, L)
    for row, ids in enumerate(sequences):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids) :] = 1
    return SequenceBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=torch.zeros((len(sequences), 0), dtype=torch.bool),
        prompt_width=width,
    )
