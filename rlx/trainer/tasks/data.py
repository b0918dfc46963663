"""Prompt datasets (jsonl, parquet incl. verl's GSM8K layout) and a resumable sampler.

verl's layout, which `rlx` reads as is:

    data_source: str
    prompt: list of {"role": str, "content": str}   (chat messages)
    reward_model: {"ground_truth": str, "style": str}

Select the answer with the dotted key `reward_model.ground_truth`.

A dataset repository on the Hugging Face hub (hf://org/name[@revision], rlx.hub fetches its
snapshot) is read with the datasets library, one configuration's split (HubSource), streamed
from the snapshot's files: nothing is written beside them.

How a prompt becomes text is a ChatFormat (chat template on or off, its extra variables, a
system prompt, a template of one's own): the recipe's trainer.data gives one
(ChatFormat.of_settings), and anything else that renders prompts builds its own.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlx.errors import RlxError, first_line
from rlx.recipe.model import DataSettings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

FORMATS: dict[str, tuple[str, ...]] = {
    "jsonl": (".jsonl", ".ndjson"),
    "parquet": (".parquet",),
}
OVERLONG_POLICIES: tuple[str, ...] = ("filter", "truncate", "error")


class DataError(RlxError, ValueError):
    """A dataset that cannot be read as prompts; the message names the file and the fix."""


# ---------------------------------------------------------------------------------------
# Reading rows


def detect_format(path: Path, data_format: str | None = None) -> str:
    """The format named explicitly, or the one the file suffix implies."""
    if data_format is not None:
        if data_format not in FORMATS:
            raise DataError(f"unknown data format {data_format!r}; valid: {', '.join(FORMATS)}")
        return data_format
    for name, suffixes in FORMATS.items():
        if path.suffix.lower() in suffixes:
            return name
    known = ", ".join(suffix for suffixes in FORMATS.values() for suffix in suffixes)
    raise DataError(
        f"{path}: cannot tell the format from the suffix {path.suffix!r}; "
        f"use one of {known} or name the format ({', '.join(FORMATS)})"
    )


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{line_no}: invalid JSON: {exc.msg}") from exc
            if not isinstance(row, dict):
                raise DataError(
                    f"{path}:{line_no}: each line must be a JSON object, got {type(row).__name__}"
                )
            rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path}: not a readable parquet file: {exc}") from exc
    return table.to_pylist()


@dataclass(frozen=True)
class HubSource:
    """One split of one configuration of a dataset repository's snapshot (a folder in the
    hub cache, rlx.hub.dataset_snapshot)."""

    repo_id: str
    folder: Path
    config: str | None
    split: str

    def __str__(self) -> str:
        commit = self.folder.name[:12]
        config = f", config {self.config}" if self.config else ""
        return f"hf://{self.repo_id}@{commit} (split {self.split}{config})"


def hub_source(
    spec: str,
    config: str | None,
    split: str,
    *,
    field: str = "trainer.data.train",
    fetch: bool = True,
    env: Mapping[str, str] | None = None,
) -> HubSource | None:
    """The split an `hf://org/name[@revision]` spec names, its snapshot in this node's hub
    cache at the commit this process pinned (rlx.hub.dataset_snapshot: fetched when
    `fetch`; without, None when the cache does not hold it). RlxError: one line naming
    `field` when the id cannot be resolved."""
    from rlx.hub import dataset_snapshot
    from rlx.recipe.specs import hub_data, hub_data_problem

    named = hub_data(spec)
    if named is None:
        raise DataError(f"{field}: {spec} {hub_data_problem(spec)}")
    folder = dataset_snapshot(
        named.repo_id, revision=named.revision, field=field, env=env, fetch=fetch
    )
    return None if folder is None else HubSource(named.repo_id, folder, config, split)


def hub_part_problem(
    source: HubSource, fields: tuple[str, str] = ("data.config", "data.split")
) -> str | None:
    """Whether the snapshot has the configuration and split asked for: what is there and
    what to write (in `fields`, the recipe's config and split fields) when not (None when
    it has them)."""
    import datasets

    config_field, split_field = fields

    spec = f"hf://{source.repo_id}"
    try:
        configs = datasets.get_dataset_config_names(str(source.folder))
    except Exception as exc:  # not a layout datasets can read
        first = first_line(exc)
        return f"{spec}: the datasets library cannot read its snapshot {source.folder}: {first}"
    if source.config is None and len(configs) > 1 and "default" not in configs:
        return (
            f"{spec} has configurations {', '.join(configs)} and none is the default; "
            f"choose one with {config_field}"
        )
    if source.config is not None and source.config not in configs:
        return (
            f"{spec} has no configuration {source.config!r}; its configurations: "
            f"{', '.join(configs)}; write {config_field}: one of them"
        )
    config = source.config or ("default" if "default" in configs else configs[0])
    splits = datasets.get_dataset_split_names(str(source.folder), config)
    if source.split not in splits:
        return (
            f"{spec} (configuration {config}) has no split {source.split!r}; its splits: "
            f"{', '.join(splits)}; write {split_field}: one of them"
        )
    return None


def _hub_stream(source: HubSource) -> Iterator[dict[str, Any]]:
    import datasets

    problem = hub_part_problem(source)
    if problem is not None:
        raise DataError(problem)
    datasets.logging.disable_progress_bar()
    stream = datasets.load_dataset(
        str(source.folder), source.config, split=source.split, streaming=True
    )
    return iter(stream)


def hub_first_row(source: HubSource) -> dict[str, Any] | None:
    """The split's first row (for the columns lint and the start-up check look for)."""
    return next(_hub_stream(source), None)


def read_hub_rows(source: HubSource) -> list[dict[str, Any]]:
    """Every row of the split as dicts."""
    rows = list(_hub_stream(source))
    if not rows:
        raise DataError(f"{source}: the split holds no rows")
    return rows


def read_rows(path: str | Path | HubSource, data_format: str | None = None) -> list[dict[str, Any]]:
    """All rows of a jsonl or parquet file (or of a hub dataset's split) as dicts (structs
    become nested dicts)."""
    if isinstance(path, HubSource):
        return read_hub_rows(path)
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist")
    fmt = detect_format(path, data_format)
    rows = _read_jsonl(path) if fmt == "jsonl" else _read_parquet(path)
    if not rows:
        raise DataError(f"{path}: the file holds no rows")
    return rows


def chat_prompt_row(system: str, question: str, answer: str) -> dict[str, Any]:
    """A prompt file's row as `rlx data` writes them: the chat messages (a system message, the
    question as the user's) under `prompt`, and the reference `answer`."""
    return {
        "prompt": [
            {"role": "system", "content": system},
            {"role": "user", "content": question.strip()},
        ],
        "answer": answer,
    }


def get_field(row: Mapping[str, Any], key: str) -> Any:
    """row[key], where a dotted key walks into nested dicts ("reward_model.ground_truth").

    A key that exists literally (a column named "a.b") wins over the nested reading.
    Raises KeyError whose message names the missing part and the keys that exist there.
    """
    if key in row:
        return row[key]
    node: Any = row
    walked: list[str] = []
    for part in key.split("."):
        if not isinstance(node, Mapping):
            raise KeyError(
                f"key {key!r}: {'.'.join(walked)!r} is a {type(node).__name__}, not a mapping"
            )
        if part not in node:
            where = f"under {'.'.join(walked)!r}" if walked else "in the row"
            raise KeyError(
                f"key {key!r}: no {part!r} {where}; keys there: {', '.join(map(str, node))}"
            )
        node = node[part]
        walked.append(part)
    return node


# ---------------------------------------------------------------------------------------
# Prompts


@dataclass(frozen=True)
class PromptDataset:
    """Prompts ready for generation, aligned by position.

    prompts: the text the policy sees (after the chat template, after any truncation).
    prompt_token_ids: its token ids. answers: reference answers (None where absent).
    row_indices: the row of the file each prompt came from (rows may be filtered out).
    """

    source: str
    prompts: list[str]
    prompt_token_ids: list[list[int]]
    answers: list[str | None]
    row_indices: list[int]
    n_filtered: int = 0
    n_truncated: int = 0
    columns: list[Mapping[str, Any]] = field(default_factory=list)  # each prompt's whole row
    # Each prompt as the chat messages it was rendered from (a text prompt: one user
    # message), for readers that render it their own way (a reward model's template).
    messages: list[list[dict[str, str]]] = field(default_factory=list)
    # The commit each dataset repository read was at: {"hf://org/name": commit}, which a
    # checkpoint records so a resume reads what the run started with.
    revisions: Mapping[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)

    def summary(self) -> str:
        return (
            f"{self.source}: {len(self)} prompts "
            f"({self.n_filtered} filtered, {self.n_truncated} truncated as overlong)"
        )


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) > 0
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value)
    )


def _answer_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@dataclass(frozen=True)
class ChatFormat:
    """How prompts become the text the policy reads.

    for_strings: text prompts go through the chat template too (as one user message);
    chat messages always do. kwargs: extra variables the template reads
    (enable_thinking=False). system_prompt: a system message put first, unless the
    prompt's messages begin with their own. template: Jinja text used instead of the
    tokenizer's template (template_text reads one given as a file)."""

    for_strings: bool = False
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    system_prompt: str | None = None
    template: str | None = None

    @classmethod
    def of_settings(cls, data: DataSettings, base_dir: Path | None = None) -> ChatFormat:
        """The format a recipe's trainer.data asks for (a template file found from
        base_dir, the folder the job runs in, when relative)."""
        template = data.chat_template_override
        return cls(
            for_strings=data.chat_template,
            kwargs=dict(data.chat_template_kwargs),
            system_prompt=data.system_prompt,
            template=None if template is None else template_text(template, base_dir),
        )


def is_template_text(value: str) -> bool:
    """Whether a template override is Jinja text rather than a file's name."""
    return "{{" in value or "{%" in value


def template_file(value: str, base_dir: Path | None = None) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() or base_dir is None else base_dir / path


def template_text(value: str, base_dir: Path | None = None) -> str:
    """A template override as Jinja text: as written, or its file's content."""
    if is_template_text(value):
        return value
    path = template_file(value, base_dir)
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DataError(
            f"chat template {value!r}: cannot read {path} ({exc.strerror or exc}); give a "
            "Jinja file, or the template itself"
        ) from None


def prompt_messages(value: Any, chat: ChatFormat | None = None) -> list[dict[str, str]]:
    """A prompt value as chat messages: a string is one user message; chat's system prompt
    goes first unless the messages begin with their own."""
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif _is_messages(value):
        messages = [{"role": m["role"], "content": m["content"]} for m in value]
    else:
        raise DataError(
            "a prompt must be a string or a list of {'role', 'content'} messages, "
            f"got {type(value).__name__}: {str(value)[:80]!r}"
        )
    if chat is not None and chat.system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": chat.system_prompt})
    return messages


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    value: Any,
    *,
    chat_template_for_strings: bool | None = None,
    chat: ChatFormat | None = None,
) -> str:
    """The text a prompt value stands for: chat messages go through the chat template
    (with the generation prompt); plain strings only when asked to. `chat` says how
    (chat_template_for_strings alone: the tokenizer's template, nothing added)."""
    if chat is None:
        chat = ChatFormat(for_strings=bool(chat_template_for_strings))
    if isinstance(value, str) and not chat.for_strings:
        return value
    messages = prompt_messages(value, chat)
    if chat.template is None and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "the tokenizer has no chat template, so chat-message prompts cannot be rendered; "
            "use a tokenizer with one, give data.chat_template_override, or plain string "
            "prompts without the chat template"
        )
    return tokenizer.apply_chat_template(
        messages,
        chat_template=chat.template,
        tokenize=False,
        add_generation_prompt=True,
        **chat.kwargs,
    )


def _check_limit(overlong: str, max_prompt_length: int | None) -> None:
    if overlong not in OVERLONG_POLICIES:
        raise DataError(
            f"unknown overlong policy {overlong!r}; valid: {', '.join(OVERLONG_POLICIES)}"
        )
    if max_prompt_length is not None and max_prompt_length < 1:
        raise DataError(f"max_prompt_length must be at least 1, got {max_prompt_length}")


def _tokenized_prompt(
    value: Any, tokenizer: PreTrainedTokenizerBase, chat: ChatFormat, where: str
) -> tuple[str, list[int]]:
    """A row's prompt as the model reads it (rendered through the chat template where it
    takes one) and its token ids."""
    templated = not isinstance(value, str) or chat.for_strings
    try:
        text = render_prompt(tokenizer, value, chat=chat)
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from exc
    # The template already wrote any BOS it wants; plain text gets the tokenizer's own.
    return text, list(tokenizer(text, add_special_tokens=not templated)["input_ids"])


def load_prompt_dataset(
    path: str | Path | HubSource,
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_key: str = "prompt",
    answer_key: str | None = None,
    max_prompt_length: int | None = None,
    overlong: str = "filter",
    chat_template_for_strings: bool = False,
    data_format: str | None = None,
    chat: ChatFormat | None = None,
) -> PromptDataset:
    """Read prompts (and answers) from a jsonl or parquet file (or a hub dataset's split)
    and tokenize them. chat: how prompts are rendered (default: the tokenizer's template,
    for text prompts when chat_template_for_strings).

    overlong: what to do with prompts longer than max_prompt_length tokens: "filter" drops
    them, "truncate" keeps their last max_prompt_length tokens (the end, where the
    generation prompt is), "error" raises. The counts are on the result and logged.
    """
    _check_limit(overlong, max_prompt_length)
    if chat is None:
        chat = ChatFormat(for_strings=chat_template_for_strings)
    source = str(path)
    rows = read_rows(path, data_format)
    prompts: list[str] = []
    token_ids: list[list[int]] = []
    answers: list[str | None] = []
    kept_rows: list[int] = []
    messages: list[list[dict[str, str]]] = []
    n_filtered = n_truncated = 0
    for index, row in enumerate(rows):
        where = f"{source}: row {index}"
        try:
            value = get_field(row, prompt_key)
            answer = _answer_text(get_field(row, answer_key)) if answer_key else None
        except KeyError as exc:
            raise DataError(f"{where}: {exc.args[0]}") from exc
        text, ids = _tokenized_prompt(value, tokenizer, chat, where)
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            if overlong == "error":
                raise DataError(
                    f"{where}: prompt has {len(ids)} tokens, more than "
                    f"max_prompt_length {max_prompt_length}; raise the limit or filter/truncate"
                )
            if overlong == "filter":
                n_filtered += 1
                continue
            ids = ids[-max_prompt_length:]
            text = tokenizer.decode(ids, skip_special_tokens=False)
            n_truncated += 1
        prompts.append(text)
        token_ids.append(ids)
        answers.append(answer)
        kept_rows.append(index)
        messages.append(prompt_messages(value, chat))
    if not prompts:
        raise DataError(
            f"{source}: all {len(rows)} prompts are longer than max_prompt_length "
            f"{max_prompt_length} tokens"
        )
    dataset = PromptDataset(
        source=source,
        prompts=prompts,
        prompt_token_ids=token_ids,
        answers=answers,
        row_indices=kept_rows,
        n_filtered=n_filtered,
        n_truncated=n_truncated,
        columns=[rows[i] for i in kept_rows],
        messages=messages,
        revisions=(
            {f"hf://{path.repo_id}": path.folder.name} if isinstance(path, HubSource) else {}
        ),
    )
    if n_filtered or n_truncated:
        logger.warning("%s", dataset.summary())
    return dataset


# ---------------------------------------------------------------------------------------
# Sampling


def load_recipe_prompts(
    path: Path | HubSource, tokenizer: Any, data: DataSettings, base_dir: Path | None = None
) -> PromptDataset:
    """A prompt file (or hub dataset split) read and tokenized as the recipe's
    `trainer.data` says (keys, length limit and overlong policy, chat format, file format):
    the training set and the held-out set alike. base_dir: where a relative template file
    is (the folder the job runs in; None: this process's)."""
    return load_prompt_dataset(
        path,
        tokenizer,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        max_prompt_length=data.max_prompt_length,
        overlong={"left": "truncate"}.get(data.truncate, data.truncate),
        data_format=None if data.format == "auto" else data.format,
        chat=ChatFormat.of_settings(data, base_dir),
    )


def mix_datasets(parts: Sequence[tuple[PromptDataset, float]], seed: int) -> PromptDataset:
    """One training set from several, weighed: as many prompts as they hold together, each
    part's share in proportion to its weight. A part gives its rows in a seeded order, again
    from the start where its share is larger than it is; rows keep their own index."""
    import numpy as np

    if len(parts) == 1:
        return parts[0][0]
    total = sum(len(data) for data, _ in parts)
    weight = sum(w for _, w in parts)
    wanted = [round(total * w / weight) for _, w in parts]
    rng = np.random.default_rng(seed)
    picked: list[tuple[PromptDataset, int]] = []
    for (data, _), count in zip(parts, wanted, strict=True):
        order = rng.permutation(len(data)).tolist()
        picked += [(data, order[i % len(data)]) for i in range(count)]
    shares = zip(parts, wanted, strict=True)
    counts = ", ".join(f"{count} from {data.source}" for (data, _), count in shares)
    return PromptDataset(
        source=f"a mix of {len(parts)} datasets ({counts})",
        prompts=[data.prompts[i] for data, i in picked],
        prompt_token_ids=[data.prompt_token_ids[i] for data, i in picked],
        answers=[data.answers[i] for data, i in picked],
        row_indices=[data.row_indices[i] for data, i in picked],
        n_filtered=sum(data.n_filtered for data, _ in parts),
        n_truncated=sum(data.n_truncated for data, _ in parts),
        columns=[data.columns[i] if data.columns else {} for data, i in picked],
        messages=(
            [data.messages[i] for data, i in picked]
            if all(data.messages for data, _ in parts)
            else []
        ),
        revisions={k: v for data, _ in parts for k, v in data.revisions.items()},
    )


class PromptSampler:
    """Batches of row indices, epoch after epoch, deterministic and resumable.

    Each epoch is a permutation drawn from `seed + epoch` (or 0..n-1 without shuffling),
    cut into full batches; the rows of an incomplete last batch wait for the next epoch's
    permutation instead (every batch has exactly `batch_size` rows). state_dict() taken
    between batches and loaded into a fresh sampler continues with exactly the batches an
    uninterrupted run would have produced.
    """

    def __init__(self, n_rows: int, batch_size: int, seed: int, shuffle: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if n_rows < batch_size:
            raise ValueError(
                f"the dataset has {n_rows} prompts, fewer than one batch of {batch_size}"
            )
        self.n_rows = n_rows
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.batch_in_epoch = 0
        self._order = self._epoch_order(0)

    @property
    def batches_per_epoch(self) -> int:
        return self.n_rows // self.batch_size

    def _epoch_order(self, epoch: int) -> list[int]:
        import numpy as np

        if not self.shuffle:
            return list(range(self.n_rows))
        return np.random.default_rng(self.seed + epoch).permutation(self.n_rows).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        if self.batch_in_epoch == self.batches_per_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0
            self._order = self._epoch_order(self.epoch)
        start = self.batch_in_epoch * self.batch_size
        self.batch_in_epoch += 1
        return self._order[start : start + self.batch_size]

    def state_dict(self) -> dict[str, Any]:
        return {
            "n_rows": self.n_rows,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state`; the dataset size, batch size, seed and shuffle must match,
        or the resumed run would not see the batches the original one would have."""
        for name in ("n_rows", "batch_size", "seed", "shuffle"):
            if state[name] != getattr(self, name):
                raise ValueError(
                    f"sampler state has {name}={state[name]!r} but this sampler has "
                    f"{getattr(self, name)!r}; resume with the same data and settings"
                )
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
        self._order = self._epoch_order(self.epoch)
