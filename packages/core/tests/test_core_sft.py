"""Fine-tuning rows without processes (issue 34): which tokens are answers, rows packed
whole with their boundaries, the same rows in memory, from prepared shards and from a
stream (and after a stream's resume), and bad input named before anything runs."""

import json

import numpy as np
import pytest
import torch

from paraxis.config.run import DataSection, RunConfig
from paraxis.parallel.batch import IGNORE_INDEX, Batch
from paraxis.testing.chat import (
    MARKED_TEMPLATE,
    PLAIN_TEMPLATE,
    chat_rows,
    prompt_response_rows,
    write_tokenizer,
)
from paraxis.train.checks import check_data
from paraxis.train.example_rows import ExampleRows, pack_examples, row_plan
from paraxis.train.sft import ChatEncoder, example_encoder
from paraxis.train.tokenize import load_tokenizer

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

SEQ = 48


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    for name, template in [("marked", MARKED_TEMPLATE), ("plain", PLAIN_TEMPLATE),
                           ("none", None)]:
        write_tokenizer(root / name, template)
    for name, rows in [("chat", chat_rows(60)), ("pr", prompt_response_rows(60))]:
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def data(files, fmt="chat", **kw):
    source = files / ("chat.jsonl" if fmt == "chat" else "pr.jsonl")
    return DataSection(source=str(source), format=fmt, tokenizer=str(files / "marked"),
                       shuffle=False, **kw)


def answers_by_hand(tok, messages):
    """The assistant contents and their EOS, found in the rendered text by hand."""
    text = tok.apply_chat_template(messages, tokenize=False)
    spans, cursor, header = [], 0, "<|assistant|>\n"
    for m in messages:
        if m["role"] == "assistant":
            start = text.index(header + m["content"] + tok.eos_token, cursor) + len(header)
            cursor = start + len(m["content"] + tok.eos_token)
            spans.append((start, cursor))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], [any(s < e and b < end for b, e in spans)
                              for s, end in enc["offset_mapping"]]


def test_the_answers_are_the_assistant_turns_with_or_without_markers(files):
    marked, plain = (load_tokenizer(str(files / n)) for n in ("marked", "plain"))
    by_markers, by_prefixes = ChatEncoder(marked, "messages"), ChatEncoder(plain, "messages")
    assert by_markers.marked and not by_prefixes.marked
    for row in chat_rows(12):
        ids, answer = answers_by_hand(marked.hf, row["messages"])
        for example in (by_markers(row), by_prefixes(row)):
            assert example.ids.tolist() == ids and example.answer.tolist() == answer
        words = marked.hf.decode(example.ids[example.answer]).split()
        assert words == [w for m in row["messages"] if m["role"] == "assistant"
                         for w in (m["content"], "</s>")], words


def test_prompt_response_scores_the_response_and_its_separator(files):
    tok = load_tokenizer(str(files / "marked"))
    row = next(prompt_response_rows(1))
    example = example_encoder(data(files, "prompt_response"), tok)(row)
    asked = tok.encode(row["prompt"])
    assert example.ids.tolist() == [*asked, *tok.encode(row["response"]), tok.separator]
    assert example.answer.tolist() == [False] * len(asked) + [True] * (
        len(example.ids) - len(asked))


def test_a_template_that_rewrites_earlier_turns_is_refused_asking_for_markers(files):
    tok = load_tokenizer(str(files / "plain"))
    # Renders only the last assistant turn's content (as templates that drop past
    # reasoning do): a prefix is not the start of the whole.
    tok.hf.chat_template = PLAIN_TEMPLATE.replace(
        "{{ m['content'] }}{{ eos_token }}{% endif %}",
        "{% if loop.last %}{{ m['content'] }}{% endif %}{{ eos_token }}{% endif %}")
    row = next(r for r in chat_rows(4) if len(r["messages"]) > 3)
    with pytest.raises(ValueError, match="generation"):
        ChatEncoder(tok, "messages")(row)


def test_rows_hold_whole_examples_apart_and_score_only_the_answers(files):
    cfg = data(files)
    rows = pack_examples(cfg, SEQ, load_tokenizer(cfg.tokenizer))
    lengths = rows.ends - rows.starts
    assert (lengths <= SEQ).all() and rows.plan[-1] == len(lengths)  # every example, once
    batch = rows[torch.arange(len(rows))]
    tok = load_tokenizer(cfg.tokenizer)
    for r in range(len(rows)):  # each row: its examples back to back, then padding
        first, last = int(rows.plan[r]), int(rows.plan[r + 1])
        used = int(lengths[first:last].sum())
        assert used <= SEQ and (r + 1 == len(rows) or used + lengths[last] > SEQ)
        want = ExampleRows.from_examples(
            [ChatEncoder(tok, "messages")(row) for row in list(chat_rows(60))[first:last]],
            SEQ, pad=tok.separator, answers_only=True).row(0)
        for key in want:
            assert torch.equal(batch[key][r], want[key]), (r, key)
        assert (batch["labels"][r, used:] == IGNORE_INDEX).all()
        apart = [torch.arange(n) for n in [*lengths[first:last].tolist(), SEQ - used]]
        assert torch.equal(batch["position_ids"][r], torch.cat(apart)), r
    targets = Batch.from_user(batch).targets  # nothing predicted across an example's end
    starts = batch["position_ids"][:, 1:] == 0
    assert (targets[:, :-1][starts] == IGNORE_INDEX).all()
    everything = pack_examples(data(files, loss_on="all"), SEQ, tok)[torch.arange(2)]
    real = everything["labels"] != IGNORE_INDEX
    assert torch.equal(everything["labels"][real], everything["input_ids"][real])
    assert real.sum() > (batch["labels"][:2] != IGNORE_INDEX).sum()


def test_row_plan_packs_in_order_and_cuts_only_an_example_longer_than_a_row():
    # [3 4] [2] [9, cut to 8] [1] [8] [5 3]: a row closes when the next example does not fit
    assert row_plan(np.array([3, 4, 2, 9, 1, 8, 5, 3]), 8).tolist() == [0, 2, 3, 4, 5, 6, 8]


@pytest.mark.parametrize("fmt", ["chat", "prompt_response"])
def test_prepared_shards_and_a_stream_give_the_in_memory_rows(files, tmp_path, fmt):
    from paraxis.cli.main import main
    from paraxis.train.stream import StreamBatches
    from paraxis.train.stream_examples import ExamplePacker

    cfg = data(files, fmt)
    tok = load_tokenizer(cfg.tokenizer)
    memory = pack_examples(cfg, SEQ, tok)
    assert main(["data", "prepare", cfg.source, "--out", str(tmp_path / "p"), "--format",
                 fmt, "--tokenizer", cfg.tokenizer, "--quiet"]) == 0
    prepared = pack_examples(cfg.model_copy(update={"source": str(tmp_path / "p")}), SEQ,
                             tok)
    assert isinstance(prepared.tokens, np.memmap) and len(prepared) == len(memory)

    def stream(state=None):
        s = StreamBatches(cfg.source, tokenizer=tok, seq_length=SEQ, global_batch=4,
                          rank=0, ranks=1, packer=lambda **kw: ExamplePacker(
                              **kw, encode=example_encoder(cfg, tok), pad=tok.separator,
                              answers_only=True))
        if state is not None:
            s.load_state_dict(json.loads(json.dumps(state)))
        return s

    # Into the second epoch (the stream's first ends on its last row, padded, as the
    # plan's does), resuming from a saved position twice on the way.
    streamed, batches = stream(), -(-len(memory) // 4) + 2
    for b in range(batches):
        if b in (3, batches - 2):
            streamed = stream(streamed.state_dict())
        index = torch.arange(4 * b, 4 * b + 4) % len(memory)
        want, got = memory[index], streamed.next_batch()
        for key in want:
            assert torch.equal(prepared[index][key], want[key]), (b, key)
            assert torch.equal(got[key], want[key]), (b, key)


def problems(files, **data_fields):
    cfg = RunConfig.from_dict({"data": {"tokenizer": str(files / "marked"), **data_fields}})
    return [(p.field, p.rule) for p in check_data(cfg)]


def test_bad_fine_tuning_input_is_named_before_anything_runs(files, tmp_path):
    chat, pr = str(files / "chat.jsonl"), str(files / "pr.jsonl")
    datasets.Dataset.from_list(list(chat_rows(3))).save_to_disk(tmp_path / "saved")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": "hello"}) + "\n")
    cases = {
        "no template": (dict(source=chat, format="chat", tokenizer=str(files / "none")),
                        "data.tokenizer", "has no chat_template"),
        "bytes": (dict(source=chat, format="chat", tokenizer="bytes"), "data.tokenizer",
                  "byte tokenizer, which has no chat template"),
        "fields": (dict(source=chat, format="prompt_response"), "data.source",
                   "rows have no field 'prompt' or 'response'"),
        "messages field": (dict(source=pr, format="chat"), "data.source",
                           "rows have no field 'messages'"),
        "saved": (dict(source=str(tmp_path / "saved"), format="chat",
                       messages_field="turns"), "data.source", "has no column 'turns'"),
        "stream": (dict(source=pr, format="chat", streaming=True), "data.source",
                   "has no column 'messages'"),
        "not a chat": (dict(source=str(tmp_path / "bad.jsonl"), format="chat"),
                       "data.source", "'messages' is not a non-empty list"),
        "text answers": (dict(source=chat, text_field="messages", loss_on="answers"),
                         "data.loss_on", "format text has no answers"),
        "masking off": (dict(source=chat, format="chat", document_masking=False),
                        "data.document_masking", "keeps its examples apart"),
    }
    for name, (fields, field, says) in cases.items():
        found = problems(files, **fields)
        assert len(found) == 1 and found[0][0] == field and says in found[0][1], (name, found)
    assert problems(files, source=chat, format="chat") == []
    assert problems(files, source=pr, format="prompt_response") == []


def test_prepared_rows_must_be_read_as_the_format_they_were_prepared_from(files, tmp_path):
    from paraxis.cli.main import main

    assert main(["data", "prepare", str(files / "chat.jsonl"), "--out", str(tmp_path),
                 "--format", "chat", "--tokenizer", str(files / "marked"), "--quiet"]) == 0
    assert problems(files, source=str(tmp_path), format="chat") == []
    ((field, rule),) = problems(files, source=str(tmp_path), format="prompt_response")
    assert field == "data.source" and "prepared from chat rows, not data.format " \
        "prompt_response" in rule
    (tmp_path / "loss_mask.bin").write_bytes(b"\0")
    ((_, rule),) = problems(files, source=str(tmp_path), format="chat")
    assert "loss_mask.bin holds 1 bytes" in rule


def test_the_older_spelling_of_the_source_format_still_reads():
    assert DataSection(format="jsonl").source_format == "jsonl"
    assert DataSection(format="jsonl").format == "text"
    with pytest.raises(ValueError, match="older spelling"):
        DataSection(format="tokens", source_format="auto")


@pytest.mark.parametrize("command", ["validate", "train"])
def test_the_cli_says_each_bad_input_in_one_line_before_any_process(files, tmp_path,
                                                                     command, capsys):
    import yaml

    from paraxis.cli.main import main

    chat = str(files / "chat.jsonl")
    cases = [({"format": "chat", "tokenizer": str(files / "none")},
              "data.tokenizer = ", "has no chat_template"),
             ({"format": "prompt_response"}, "data.source = ",
              "rows have no field 'prompt' or 'response'"),
             ({"text_field": "messages", "loss_on": "answers"}, "data.loss_on = 'answers'",
              "format text has no answers")]
    for fields, field, says in cases:
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump({
            "model": {"family": "llama", "config": {"vocab_size": 128}},
            "data": {"source": chat, "tokenizer": str(files / "marked"), **fields}}))
        assert main([command, "--config", str(config)]) == 1
        err = capsys.readouterr().err
        (line,) = [line for line in err.splitlines() if says in line]
        assert field in line and "Fix:" in line, err
        assert "torch.distributed" not in err and not torch.distributed.is_initialized()
