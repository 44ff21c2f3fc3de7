"""``paraxis data prepare``: tokenize a corpus once into memory-mapped shards
(:mod:`paraxis.train.shards`) that ``data.source`` then trains on."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

__all__ = ["add_data_commands"]


def _cmd_prepare(args: argparse.Namespace) -> int:
    """Tokenize SOURCE into DIR: tokens.bin, documents.npy, meta.json (and loss_mask.bin
    for prompt_response and chat rows)."""
    from pathlib import Path

    from paraxis.config.run import DataSection
    from paraxis.train.data import load_tokenizer
    from paraxis.train.reading import iter_documents, iter_examples
    from paraxis.train.sft import example_encoding, template_problem
    from paraxis.train.shards import prepare

    if args.source != "stdlib" and not Path(args.source).exists():
        print(f"paraxis data prepare: {args.source} does not exist", file=sys.stderr)
        return 1
    try:  # here, before any worker: a missing or unreadable tokenizer is one line
        tokenizer = load_tokenizer(args.tokenizer)
    except OSError as exc:
        print(f"paraxis data prepare: --tokenizer: {exc}", file=sys.stderr)
        return 1
    stored = {} if args.source_format is None else {"source_format": args.source_format}
    cfg = DataSection(source=args.source, format=args.format, text_field=args.text_field,
                      prompt_field=args.prompt_field, response_field=args.response_field,
                      messages_field=args.messages_field, tokenizer=args.tokenizer,
                      max_bytes=args.max_bytes, **stored)
    why = template_problem(tokenizer) if cfg.format == "chat" else None
    if why is not None:
        print(f"paraxis data prepare: --format chat: the tokenizer {args.tokenizer} {why}",
              file=sys.stderr)
        return 1
    rows = iter_examples(cfg) if cfg.finetuning else iter_documents(cfg)
    encoding = (example_encoding, (cfg, load_tokenizer, args.tokenizer)) \
        if cfg.finetuning else None
    start = time.perf_counter()
    with _progress(not args.quiet) as progress:
        try:
            meta = prepare(rows, args.out, load_tokenizer=load_tokenizer,
                           tokenizer_name=args.tokenizer, source=args.source,
                           workers=args.workers, progress=progress, rows=cfg.format,
                           encoding=encoding, tokenizer=tokenizer)
        except KeyError as exc:
            print(f"paraxis data prepare: rows of {args.source} have no field {exc}; set "
                  "--text-field", file=sys.stderr)
            return 1
        except ValueError as exc:  # a fine-tuning row the format cannot read
            print(f"paraxis data prepare: {args.source}: {exc}", file=sys.stderr)
            return 1
    seconds = time.perf_counter() - start
    print(f"{args.out}: {meta['documents']:,} {'examples' if cfg.finetuning else 'documents'}"
          f", {meta['tokens']:,} {meta['dtype']} tokens in {seconds:.1f} s "
          f"({meta['tokens'] / max(seconds, 1e-9):,.0f} tokens/s, {args.workers} worker(s))")
    return 0


class _progress:
    """A rich progress line (documents, tokens) while preparing, or nothing."""

    def __init__(self, enabled: bool):
        self.enabled, self.bar = enabled, None

    def __enter__(self) -> Any:
        if not self.enabled:
            return None
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.bar = Progress(SpinnerColumn(), TextColumn("[bold]prepare"),
                            TextColumn("{task.fields[docs]} documents, {task.fields[toks]} "
                                       "tokens"), TimeElapsedColumn())
        self.bar.__enter__()
        task = self.bar.add_task("prepare", total=None, docs="0", toks="0")

        def update(docs: int, tokens: int) -> None:
            if docs % 256 == 0:
                self.bar.update(task, docs=f"{docs:,}", toks=f"{tokens:,}")

        return update

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def add_data_commands(sub: Any) -> None:
    data = sub.add_parser("data", help="corpora: prepare memory-mapped token shards")
    verbs = data.add_subparsers(dest="verb", required=True)
    prep = verbs.add_parser("prepare", help=_cmd_prepare.__doc__)
    prep.add_argument("source", help="stdlib, a text/JSONL file or directory, or a saved "
                      "datasets dataset")
    prep.add_argument("--out", required=True, help="directory to write")
    prep.add_argument("--format", default="text",
                      choices=["text", "prompt_response", "chat", "auto", "jsonl", "hf_disk"],
                      help="what a row is (data.format); auto, jsonl and hf_disk are the "
                      "older spelling of --source-format")
    prep.add_argument("--source-format", default=None,
                      choices=["auto", "text", "jsonl", "hf_disk"],
                      help="how the source is stored (default: told from the path)")
    prep.add_argument("--text-field", default="text", help="JSONL/dataset field")
    prep.add_argument("--prompt-field", default="prompt", help="with --format prompt_response")
    prep.add_argument("--response-field", default="response",
                      help="with --format prompt_response")
    prep.add_argument("--messages-field", default="messages", help="with --format chat")
    prep.add_argument("--tokenizer", default="bytes",
                      help="bytes, or the path of a local Hugging Face tokenizer")
    prep.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    prep.add_argument("--max-bytes", type=int, default=2**62, help="stop after this much text")
    prep.add_argument("--quiet", action="store_true", help="no progress line")
    prep.set_defaults(func=_cmd_prepare)
