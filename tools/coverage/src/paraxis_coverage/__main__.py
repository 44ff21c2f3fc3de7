"""``python -m paraxis_coverage``: run the matrix and write ``docs/coverage.md``.

    python -m paraxis_coverage                       every type; writes docs/coverage.md
    python -m paraxis_coverage --only llama gemma2   some of them (no report unless --out)
    python -m paraxis_coverage --json rows.json      keep every row (written as it goes)
    python -m paraxis_coverage --json rows.json --resume   skip the rows already there
    python -m paraxis_coverage --from-json rows.json       only rewrite the report
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m paraxis_coverage",
                                description="Every transformers causal LM through paraxis' "
                                            "parallel layouts, against one process.")
    p.add_argument("--out", default=None, help="the report (markdown); default "
                   "docs/coverage.md for a full run, none for --only")
    p.add_argument("--json", default=None, help="also write every row here (JSON)")
    p.add_argument("--resume", action="store_true", help="keep the rows --json already holds")
    p.add_argument("--from-json", default=None, help="render the report from this JSON")
    p.add_argument("--only", nargs="*", default=None, help="model types to run")
    p.add_argument("--timeout", type=float, default=None, help="seconds per check")
    return p


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def _versions() -> str:
    import torch
    import transformers

    return f"transformers {transformers.__version__}, torch {torch.__version__}"


def _verdict(row) -> str:  # type: ignore[no-untyped-def]
    f = row.family
    if f.not_text or f.error:
        return f"not text-only: {f.not_text}" if f.not_text else f"not built: {f.error}"
    return ", ".join(f"{k} {v.status}" for k, v in row.cells.items())


def _run(types: dict[str, str], args: argparse.Namespace, checks: list) -> list:  # type: ignore[type-arg]
    from paraxis.testing.distributed import WorldPool
    from paraxis_coverage.report import rows_from_json, rows_to_json
    from paraxis_coverage.runner import CHECK_TIMEOUT, run_matrix

    done = {}
    if args.resume and args.json and Path(args.json).exists():
        done = {r.family.model_type: r for r in rows_from_json(Path(args.json).read_text())}
    rows: list = []  # type: ignore[type-arg]

    def progress(row) -> None:  # type: ignore[no-untyped-def]
        rows.append(row)
        print(f"[{len(rows)}/{len(types)}] {row.family.model_type} ({row.seconds:.0f}s): "
              f"{_verdict(row)}", flush=True)
        if args.json:
            Path(args.json).write_text(rows_to_json(rows))

    worlds = WorldPool(timeout=60.0)  # gloo's collective timeout inside the ranks
    try:
        run_matrix(types, checks, worlds, timeout=args.timeout or CHECK_TIMEOUT, done=done,
                   progress=progress)
    finally:
        worlds.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _quiet()
    from paraxis_coverage.cells import available_checks
    from paraxis_coverage.report import render, rows_from_json, with_readme_table
    from paraxis_hf.families import causal_lm_types

    checks = available_checks()
    start = time.perf_counter()
    if args.from_json:
        rows = rows_from_json(Path(args.from_json).read_text())
        seconds = sum(r.seconds for r in rows)
    else:
        types = causal_lm_types()
        if args.only:
            unknown = sorted(set(args.only) - set(types))
            if unknown:
                print(f"not causal-LM model types: {unknown}", file=sys.stderr)
                return 2
            types = {t: c for t, c in types.items() if t in args.only}
        print(f"{len(types)} model types; checks: {[c.name for c in checks]}", flush=True)
        rows = _run(types, args, checks)
        seconds = time.perf_counter() - start
    out = args.out or (None if args.only else "docs/coverage.md")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(render(rows, checks, versions=_versions(), seconds=seconds))
        if out == "docs/coverage.md" and Path("README.md").exists():  # the README's copy
            readme = Path("README.md")
            readme.write_text(with_readme_table(readme.read_text(), Path(out).read_text()))
    print(f"{len(rows)} rows in {seconds / 60:.1f} min" + (f"; wrote {out}" if out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
