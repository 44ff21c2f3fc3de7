"""``paraxis data prepare``'s tokens per second per worker against the bare fast
tokenizer's, on the same documents, paired (issue 38, item 5: within 1.3x).

The tokenizer is a byte-level BPE of 32,000 tokens trained here on the corpus (the
``tokenizers`` library; nothing is downloaded), saved as a transformers fast tokenizer.
The corpus is ``--max-bytes`` of the standard library's sources, read once into memory.
Bare: the tokenizer's own ``encode_batch`` over the documents in batches of 64, in one
process and one thread (``TOKENIZERS_PARALLELISM=false``, as in each worker), counting
only the encoding. Prepared: ``paraxis data prepare stdlib --tokenizer DIR --workers W``
end to end as a user runs it (its own reported tokens/s: reading, encoding, writing the
shards), divided by W. The two alternate, who goes first rotating; a round's ratio is
bare per worker over prepared per worker (lower is better; target <= 1.3).

    python benchmarks/data_prepare.py [--workers 1] [--rounds 5] [--max-bytes 8000000]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import OUT, machine, median, ratio_line, summary, write_section

ROOT = Path(__file__).resolve().parents[1]
TARGET = 1.3
VOCAB = 32_000


def documents(max_bytes: int) -> list[str]:
    from paraxis.config.run import DataSection
    from paraxis.train.reading import iter_documents

    return list(iter_documents(DataSection(source="stdlib", max_bytes=max_bytes)))


def tokenizer_dir(docs: list[str]) -> Path:
    """A 32k byte-level BPE trained on ``docs``, saved once under benchmarks/out."""
    where = OUT / f"bpe{VOCAB}"
    if (where / "tokenizer.json").exists():
        return where
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(where)
    return where


def bare_rate(where: Path, docs: list[str]) -> float:
    """Tokens per second of the tokenizer's own batch encoding, one thread."""
    from transformers import AutoTokenizer

    backend = AutoTokenizer.from_pretrained(str(where)).backend_tokenizer
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(docs), 64):
        tokens += sum(len(e.ids) for e in backend.encode_batch(docs[i:i + 64],
                                                              add_special_tokens=False))
    return tokens / (time.perf_counter() - start)


def prepared_rate(where: Path, workers: int, max_bytes: int) -> float:
    """``paraxis data prepare``'s own tokens/s line, divided by the workers."""
    with tempfile.TemporaryDirectory(prefix="paraxis-prepare-") as out:
        done = subprocess.run(
            [sys.executable, "-m", "paraxis", "data", "prepare", "stdlib", "--out", out,
             "--tokenizer", str(where), "--workers", str(workers), "--max-bytes",
             str(max_bytes), "--quiet"], capture_output=True, text=True, check=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    match = re.search(r"\(([\d,]+) tokens/s", done.stdout)
    if match is None:
        raise RuntimeError(f"no rate in {done.stdout!r} {done.stderr[-2000:]!r}")
    return float(match.group(1).replace(",", "")) / workers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-bytes", type=int, default=8_000_000)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    docs = documents(args.max_bytes)
    where = tokenizer_dir(docs)
    rates: dict[str, list[float]] = {"bare": [], "prepared": []}
    for r in range(args.rounds):
        order = ["bare", "prepared"] if r % 2 == 0 else ["prepared", "bare"]
        for name in order:
            rates[name].append(bare_rate(where, docs) if name == "bare" else
                               prepared_rate(where, args.workers, args.max_bytes))
        print(f"round {r + 1}: bare {rates['bare'][-1]:,.0f}, prepared "
              f"{rates['prepared'][-1]:,.0f} tokens/s per worker", flush=True)
    s = summary([b / p for b, p in zip(rates["bare"], rates["prepared"], strict=True)],
                TARGET)
    line = ratio_line(f"Ratio bare / prepared per worker ({args.workers} worker(s))", s)
    print(line)
    if args.no_write:
        return
    write_section(f"data_prepare_w{args.workers}", f"""
## Data prepare: tokens per second per worker against the bare tokenizer ({args.workers} worker(s))

`python benchmarks/data_prepare.py --workers {args.workers}` (the stdlib's sources,
{args.max_bytes:,} bytes, {len(docs)} documents; a {VOCAB:,}-token byte-level BPE trained
on them; bare: its encode_batch in one thread; prepared: `paraxis data prepare` end to
end, divided by the workers; {args.rounds} rounds, alternating; {machine()}; load
average at the end {os.getloadavg()[0]:.1f})

| variant | median tokens/s per worker |
| --- | ---: |
| bare fast tokenizer (encode_batch, one thread) | {median(rates['bare']):,.0f} |
| paraxis data prepare | {median(rates['prepared']):,.0f} |

{line}
""", {"rates": rates, "ratio": s, "workers": args.workers})


if __name__ == "__main__":
    main()
