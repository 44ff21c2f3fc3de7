"""Fine-tuning rows as token ids with their answers marked (issue 34).

``data.format: prompt_response``: a row's ``prompt_field`` and ``response_field`` are
tokenized apart and joined, then the tokenizer's separator (its EOS), so the model learns
to stop; the response and that separator are the answer. Tokenizing them apart keeps
the boundary exact (one BPE merge across it would blur which token is whose), as TRL's
prompt-completion rows do.

``data.format: chat``: a row's ``messages_field`` (a list of {role, content}) is rendered
by the tokenizer's own chat template (``apply_chat_template``), which decides how a
conversation starts and ends: nothing is added. The answer is what the template marks
with ``{% generation %}`` when it has the markers (transformers'
``return_assistant_tokens_mask``), else each assistant turn's span found by rendering
prefixes of the conversation: from the end of ``messages[:i]`` with the generation
prompt to the end of ``messages[:i+1]`` (so the turn's closing tokens, its EOS, are
answer too). Either way a token is an answer token when its characters overlap a span,
transformers' own rule. A template that renders an earlier turn differently once later
turns follow (one that drops past reasoning) has no prefix spans: it is refused, asking
for markers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

import torch

from paraxis.config.run import DataSection

__all__ = ["Example", "example_encoder", "example_encoding", "has_generation_markers",
           "messages_problem", "template_problem"]

# transformers' own test for the markers (tokenization_utils_base.apply_chat_template)
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class Example(NamedTuple):
    """One row's tokens and which of them are its answer (same length)."""

    ids: torch.Tensor  # int64
    answer: torch.Tensor  # bool


def template_problem(tokenizer: Any) -> str | None:
    """Why ``tokenizer`` cannot render chat rows, or None."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        return "is the byte tokenizer, which has no chat template"
    try:
        hf.get_chat_template()
    except ValueError:
        return "has no chat_template (tokenizer_config.json or chat_template.jinja)"
    if not getattr(hf, "is_fast", False):
        return ("is a slow tokenizer: the answer tokens are found from character offsets, "
                "which only fast tokenizers give")
    return None


def has_generation_markers(tokenizer: Any) -> bool:
    return bool(_GENERATION.search(tokenizer.hf.get_chat_template()))


def messages_problem(messages: Any) -> str | None:
    """Why ``messages`` is not a conversation, or None."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        return f"is not a non-empty list of messages ({type(messages).__name__})"
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not {"role", "content"} <= m.keys():
            return f"message {i} is not a mapping with role and content ({m!r:.60})"
        if not isinstance(m["content"], str):
            return f"message {i}'s content is {type(m['content']).__name__}, not text"
    return None


def _field(record: Mapping[str, Any], name: str) -> Any:
    if not isinstance(record, Mapping) or name not in record:
        fields = ", ".join(record) if isinstance(record, Mapping) else type(record).__name__
        raise ValueError(f"a row has no field {name!r} (it has: {fields}); set the data "
                         "section's field names, or fix the row")
    return record[name]


def encode_prompt_response(record: Mapping[str, Any], *, tokenizer: Any, prompt: str,
                           response: str) -> Example:
    """prompt, response, separator; the answer is the response and the separator."""
    asked = tokenizer.encode(str(_field(record, prompt)))
    answered = tokenizer.encode(str(_field(record, response)))
    sep = torch.tensor([tokenizer.separator], dtype=torch.long)
    ids = torch.cat([asked, answered, sep])
    answer = torch.zeros(len(ids), dtype=torch.bool)
    answer[len(asked):] = True
    return Example(ids, answer)


class ChatEncoder:
    """A conversation rendered by the tokenizer's template, its assistant turns marked."""

    def __init__(self, tokenizer: Any, messages_field: str):
        why = template_problem(tokenizer)
        if why is not None:
            raise ValueError(f"data.format chat: the tokenizer {why}")
        self.hf, self.field = tokenizer.hf, messages_field
        self.marked = has_generation_markers(tokenizer)

    def __call__(self, record: Mapping[str, Any]) -> Example:
        messages = _field(record, self.field)
        why = messages_problem(messages)
        if why is not None:
            raise ValueError(f"a row's {self.field!r} {why}")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if self.marked:
            out = self.hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
            return Example(torch.tensor(out["input_ids"], dtype=torch.long),
                           torch.tensor(out["assistant_masks"], dtype=torch.bool))
        text, spans = self._prefix_spans(messages)
        out = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        return Example(torch.tensor(out["input_ids"], dtype=torch.long),
                       overlapping(out["offset_mapping"], spans))

    def _render(self, messages: list[dict[str, str]], prompt: bool = False) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=prompt)

    def _prefix_spans(self, messages: list[dict[str, str]]
                      ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and each assistant turn's character span."""
        text, spans = self._render(messages), []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            # A first message from the assistant has no prefix to render: all of it.
            before = self._render(messages[:i], prompt=True) if i else ""
            through = self._render(messages[: i + 1])
            if not (text.startswith(through) and through.startswith(before)):
                raise ValueError(
                    "the chat template renders a turn differently once later turns follow "
                    f"(turn {i} of a row), so the assistant spans cannot be found from "
                    "prefixes: mark the answers in the template with {% generation %} ... "
                    "{% endgeneration %}")
            spans.append((len(before), len(through)))
        return text, spans


def overlapping(offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]
                ) -> torch.Tensor:
    """Per token (character ``offsets``), whether it overlaps one of ``spans`` (in order):
    the rule of transformers' ``return_assistant_tokens_mask``."""
    mask, k = torch.zeros(len(offsets), dtype=torch.bool), 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        mask[i] = end > spans[k][0]
    return mask


def example_encoder(cfg: DataSection, tokenizer: Any) -> Callable[[Mapping[str, Any]], Example]:
    """What turns a row of ``cfg.format`` (prompt_response or chat) into an Example."""
    if cfg.format == "prompt_response":
        return partial(encode_prompt_response, tokenizer=tokenizer, prompt=cfg.prompt_field,
                       response=cfg.response_field)
    if cfg.format == "chat":
        return ChatEncoder(tokenizer, cfg.messages_field)
    raise ValueError(f"data.format {cfg.format!r} has no answers to mark")


def example_encoding(cfg: DataSection, load_tokenizer: Callable[[str], Any], name: str
                     ) -> Callable[[Mapping[str, Any]], tuple[Any, Any]]:
    """What a ``paraxis data prepare`` worker turns a row into: (ids, answer) as numpy
    (:func:`paraxis.train.shards.prepare`'s encoding, built in each worker)."""
    encode = example_encoder(cfg, load_tokenizer(name))

    def numpy_example(record: Mapping[str, Any]) -> tuple[Any, Any]:
        example = encode(record)
        return example.ids.numpy(), example.answer.numpy()

    return numpy_example
