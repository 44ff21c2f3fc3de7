"""A local tokenizer with a chat template and chat rows to fine-tune on (issue 34).

Nothing can be downloaded where paraxis is tested, so tests and ``examples/sft_chat.py``
make their own: a byte-pair tokenizer (``tokenizers``) trained on the rows' words,
wrapped as transformers' ``PreTrainedTokenizerFast`` with ``<s>``, ``</s>``, ``<pad>``
and role tokens, and a Jinja chat template of the usual shape (a role header, the
content, EOS) written with ``{% generation %}`` markers (:data:`MARKED_TEMPLATE`), or the
same without them (:data:`PLAIN_TEMPLATE`), or none.

The rows are small sums in words ("add three and four" -> "seven"), some with a
system message, some of two turns: an answer follows from its question, so a small
model learns to answer and then to stop at EOS in a few dozen steps.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["MARKED_TEMPLATE", "PLAIN_TEMPLATE", "chat_rows", "prompt_response_rows",
           "write_tokenizer"]

_TURN = "<|{{ m['role'] }}|>\n"
MARKED_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}" + _TURN +
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}"
    "{% endgeneration %}{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PLAIN_TEMPLATE = MARKED_TEMPLATE.replace("{% generation %}", "").replace(
    "{% endgeneration %}", "")

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
           "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
           "seventeen", "eighteen"]
SYSTEM = "you answer with one number"
SPECIALS = ["<unk>", "<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]


def _sum(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"add {NUMBERS[a]} and {NUMBERS[b]}", NUMBERS[a + b]


def chat_rows(n: int, seed: int = 0) -> Iterator[dict[str, Any]]:
    """``n`` rows ``{"messages": [...]}``: one or two sums, a system message in a third."""
    rng = random.Random(seed)
    for i in range(n):
        messages = [{"role": "system", "content": SYSTEM}] if i % 3 == 0 else []
        for _ in range(1 + (i % 4 == 1)):
            question, answer = _sum(rng)
            messages += [{"role": "user", "content": question},
                         {"role": "assistant", "content": answer}]
        yield {"messages": messages}


def prompt_response_rows(n: int, seed: int = 0) -> Iterator[dict[str, str]]:
    """``n`` rows ``{"prompt": ..., "response": ...}`` of the same sums."""
    rng = random.Random(seed)
    for _ in range(n):
        question, answer = _sum(rng)
        yield {"prompt": f"{question} =", "response": f" {answer}"}


def write_tokenizer(directory: str | Path, template: str | None = MARKED_TEMPLATE) -> Any:
    """Save the tokenizer (with ``template``, or no chat template) to ``directory``;
    returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = [" ".join(NUMBERS), SYSTEM, "add and =", "plus minus what is the"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(words * 10, trainers.BpeTrainer(vocab_size=120,
                                                             special_tokens=SPECIALS))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 pad_token="<pad>", unk_token="<unk>")
    if template is not None:
        hf.chat_template = template
    hf.save_pretrained(str(directory))
    return hf
