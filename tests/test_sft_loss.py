"""Answers-only loss end to end (issue 34): the first step's loss of ``paraxis train`` on
chat and prompt/response JSONL (one process, shuffle off, one global batch = every row)
equals a hand computation with transformers alone: the template rendered, the
assistant spans found in the text, each example run on its own, the summed
cross-entropy of the answer tokens divided by their count. Unpacked (right-padded rows)
and packed (whole examples per row, kept apart by their position ids) alike."""

import json

import pytest
import torch

from paraxis.testing.chat import chat_rows, prompt_response_rows, write_tokenizer
from paraxis.testing.tolerance import STEP_RTOL

pytest.importorskip("transformers")

ROWS, SEQ = 8, 64


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from paraxis_hf import build_debug_model

    root = tmp_path_factory.mktemp("sft_loss")
    tok = write_tokenizer(root / "tokenizer")
    build_debug_model("llama", seed=7, vocab_size=128).save_pretrained(str(root / "model"))
    for name, rows in [("chat", chat_rows(ROWS)), ("prompt_response",
                                                   prompt_response_rows(ROWS))]:
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, tok


def by_hand(tok, row):
    """(ids, answer) of a row, from its rendered text and where its answers are in it."""
    if "prompt" in row:
        asked = tok.encode(row["prompt"], add_special_tokens=False)
        ids = asked + tok.encode(row["response"], add_special_tokens=False) + [tok.eos_token_id]
        return ids, [i >= len(asked) for i in range(len(ids))]
    text = tok.apply_chat_template(row["messages"], tokenize=False)
    spans, cursor, header = [], 0, "<|assistant|>\n"
    for m in row["messages"]:
        if m["role"] == "assistant":
            start = text.index(header + m["content"] + tok.eos_token, cursor) + len(header)
            cursor = start + len(m["content"] + tok.eos_token)
            spans.append((start, cursor))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], [any(a < end and s < b for s, end in spans)
                              for a, b in enc["offset_mapping"]]


def hand_loss(root, tok, fmt):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(root / "model")).eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for line in (root / f"{fmt}.jsonl").read_text().splitlines():
            ids, answer = by_hand(tok, json.loads(line))
            logits = model(torch.tensor([ids])).logits[0, :-1]
            scored = torch.tensor(answer[1:])  # the target of position i is token i + 1
            total += torch.nn.functional.cross_entropy(
                logits[scored], torch.tensor(ids[1:])[scored], reduction="sum").double()
            count += int(scored.sum())
    return float(total / count)


def first_loss(root, fmt, packing):
    from paraxis.config.run import RunConfig
    from paraxis.train.data import load_tokenizer
    from paraxis.train.loop import train
    from paraxis.train.sources import rows_of

    cfg = RunConfig.from_dict({
        "model": {"pretrained": str(root / "model")},
        "train": {"steps": 1, "global_batch": ROWS, "seq_length": SEQ, "warmup_steps": 0,
                  "log_every": 100},
        "data": {"source": str(root / f"{fmt}.jsonl"), "format": fmt, "shuffle": False,
                 "tokenizer": str(root / "tokenizer"), "packing": packing},
        "logging": {"progress": False, "wandb": False}})
    if packing:  # one global batch = every packed row
        rows = rows_of(cfg.data)(cfg.data, SEQ, load_tokenizer(cfg.data.tokenizer))
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={
            "global_batch": len(rows)})})
    history = []
    train(cfg, history)
    return history[0]["loss"]


@pytest.mark.parametrize("fmt", ["chat", "prompt_response"])
def test_the_first_loss_is_the_mean_over_the_answers_by_hand(worlds, files, fmt):
    root, tok = files
    want = hand_loss(root, tok, fmt)
    for packing in (False, True):
        (loss,) = worlds.run(1, first_loss, root, fmt, packing)
        print(f"{fmt}, packing {packing}: first loss {loss:.8f}, by hand {want:.8f}")
        assert abs(loss - want) <= STEP_RTOL * want, (fmt, packing, loss, want)
