"""Which families ``paraxis train`` builds on the meta device, each checked against eager.

    python -m paraxis_coverage.init_census        every type; the counts and the
                                                     sentence docs/architecture.md quotes
    python -m paraxis_coverage.init_census gpt2   some of them, with their reasons

Every text-only causal LM type of the coverage matrix (its tiny config,
:func:`paraxis_hf.families.build_family`) is built as the trainer builds it,
``paraxis_hf.build.deferred_or_reason``: it *replays* (each parameter's rule recorded),
is *refused* (the trainer builds it whole, with the reason), or
*does not build* even whole. A replayed family is then compared with an eager build of
the same config (:func:`paraxis_coverage.init_compare.rule_mismatches`): the same
parameter names and shapes, each rule the distribution the eager tensor came from, the
rule's own draw too, and the buffers equal.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import warnings

import torch

from paraxis_coverage.init_compare import rule_mismatches
from paraxis_hf.families import Family, build_family, build_model, causal_lm_types
from paraxis_hf.invariant_init import InitRule, piece_values

__all__ = ["InitCensusRow", "census", "census_family", "census_sentence", "main"]

SEED = 0
STATUSES = ("replay", "refused", "not built")


@dataclasses.dataclass(frozen=True)
class InitCensusRow:
    model_type: str
    status: str  # one of STATUSES
    reason: str = ""  # why refused, or why not built
    mismatches: tuple[str, ...] = ()  # a replayed family's parameters unlike eager
    compared: int = 0  # parameters compared


def _drawn(name: str, rule: InitRule, shape: tuple[int, ...]) -> torch.Tensor:
    return piece_values(rule, seed=SEED, name=name, global_shape=shape,
                        where=tuple(slice(0, n) for n in shape), dtype=torch.float32)


def _mismatches(deferred: torch.nn.Module, rules: dict[str, InitRule],
                eager: torch.nn.Module) -> list[str]:
    """Each way the deferred model (its rules, their draw, its buffers) is not the eager
    one's distribution."""
    got = {n: p.shape for n, p in deferred.named_parameters()}
    want = dict(eager.named_parameters())
    if got.keys() != want.keys():
        return [f"parameters differ from eager: {sorted(got.keys() ^ want.keys())[:4]}"]
    out = []
    for name, param in want.items():
        if got[name] != param.shape:
            out.append(f"{name}: shape {tuple(got[name])}, eager {tuple(param.shape)}")
            continue
        out += [f"{name}: {m}" for m in rule_mismatches(rules[name], param)]
        drawn = _drawn(name, rules[name], tuple(param.shape))
        out += [f"{name} (drawn): {m}" for m in rule_mismatches(rules[name], drawn)]
    buffers = dict(eager.named_buffers())
    for name, buffer in deferred.named_buffers():
        if name in buffers and (buffer.is_meta or not torch.equal(buffer, buffers[name])):
            out.append(f"buffer {name} differs from eager")
    return out


def census_family(family: Family) -> InitCensusRow:
    """``family`` (built by the matrix) built deferred, and checked against eager."""
    from paraxis.parallel.strategy import MATERIALIZE_ATTR
    from paraxis_hf.build import deferred_or_reason

    kind = family.model_type
    if not family.built:
        return InitCensusRow(kind, "not built", family.error or "")
    overrides = dict(family.overrides or {})
    deferred, reason = deferred_or_reason(kind, overrides, SEED)  # as paraxis train
    if deferred is None:
        return InitCensusRow(kind, "refused", reason)
    rules = getattr(deferred, MATERIALIZE_ATTR).rules
    eager = build_model(kind, overrides, seed=SEED)
    return InitCensusRow(kind, "replay", mismatches=tuple(_mismatches(deferred, rules, eager)),
                         compared=len(rules))


def census(types: dict[str, str] | None = None) -> list[InitCensusRow]:
    """Every text-only type of ``types`` (default: every causal LM of transformers)."""
    rows = []
    for kind, class_name in (types or causal_lm_types()).items():
        family = build_family(kind, class_name)
        if family.not_text is None:
            rows.append(census_family(family))
    return rows


def census_sentence(rows: list[InitCensusRow]) -> str:
    """The sentence docs/architecture.md quotes, from ``rows``."""
    import transformers

    count = collections.Counter(r.status for r in rows)
    return (f"of the {len(rows)} text-only causal LM types of transformers "
            f"{transformers.__version__} (the coverage matrix's tiny configs), "
            f"{count['replay']} replay, {count['refused']} are refused and "
            f"{count['not built']} do not build even whole")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    types = causal_lm_types()
    rows = census({t: c for t, c in types.items() if t in args} if args else types)
    for row in rows:
        if row.status != "replay" or row.mismatches:
            print(f"{row.model_type}: {row.status}: {row.reason}"
                  + "".join(f"\n    {m}" for m in row.mismatches))
    print(census_sentence(rows))
    return 1 if any(r.mismatches for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
