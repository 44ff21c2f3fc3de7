"""The whole run's configuration: the parallel sections plus model, train, data, logging.

One YAML file drives ``paraxis train`` and ``paraxis validate``. ``key.path=value``
overrides on the command line are applied before validation, so they are checked like
the file itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveInt, model_validator

from paraxis.config.errors import Problem
from paraxis.config.lora import LoraSection
from paraxis.config.parallel import ParallelConfig, _Section
from paraxis.config.reporting import LoggingSection, ProfileWindow
from paraxis.config.text import apply_overrides, read_config

__all__ = ["DataSection", "EvalData", "LoggingSection", "LoraSection", "LossScaling",
           "ModelSection", "ProfileWindow", "RunConfig", "TrainSection"]


class ModelSection(_Section):
    """``family``: ``tiny`` (built in) or a transformers ``model_type`` (llama, mistral,
    qwen2, gpt2...) built from ``config`` by paraxis-hf, never downloaded."""

    family: str = "tiny"
    config: dict[str, Any] = Field(default_factory=dict)
    # A save_pretrained directory to start from (its config gives the family; ``config``
    # overrides fields); each rank reads only its slices of the weights.
    pretrained: str | None = None


class LossScaling(_Section):
    """Dynamic loss scaling for ``train.precision: fp16`` (Micikevicius et al., "Mixed
    Precision Training", arXiv:1710.03740): the loss is multiplied by ``initial`` before
    backward; a step whose gradients hold an inf or nan on any rank is skipped on every
    rank and the scale multiplied by ``backoff_factor``; after ``growth_interval`` clean
    steps in a row it is multiplied by ``growth_factor``; it never falls below
    ``min_scale``."""

    initial: float = Field(default=2.0**16, gt=0)
    growth_factor: float = Field(default=2.0, gt=1)
    backoff_factor: float = Field(default=0.5, gt=0, lt=1)
    growth_interval: PositiveInt = 1000
    min_scale: float = Field(default=1.0, gt=0)


class TrainSection(_Section):
    steps: PositiveInt = 200
    global_batch: PositiveInt = 16  # sequences per optimizer step, all replicas together
    seq_length: PositiveInt = 128
    lr: float = Field(default=3e-3, gt=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup_steps: NonNegativeInt = 10
    weight_decay: NonNegativeFloat = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: NonNegativeFloat = 1.0  # 0 disables clipping
    # fp32; bf16 or fp16: the forward's matmuls in that dtype (torch.autocast) over
    # fp32 parameters, which are the master weights, and fp32 gradients, which are the
    # main gradients (torchtitan's FSDP2 policy: param_dtype bf16, reduce_dtype fp32).
    # fp16 adds dynamic loss scaling (loss_scale). bf16: true is the older spelling of
    # precision: bf16.
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    bf16: bool = False
    loss_scale: LossScaling = LossScaling()
    # adamw, sgd (momentum 0.9 unless optimizer_kwargs says otherwise), or a
    # torch.optim.Optimizer class by import path ("torch.optim.RAdam", "pkg.mod:Cls");
    # optimizer_kwargs go to its constructor (lr, weight_decay and, where the class
    # takes them, betas come from this section).
    optimizer: str = "adamw"
    optimizer_kwargs: dict[str, Any] = Field(default_factory=dict)
    # torch.compile each transformer layer after the axes apply (engine/compile.py):
    # true is TorchInductor; a backend name (aot_eager) is passed through.
    compile: bool | Literal["inductor", "aot_eager", "eager"] = False
    seed: int = 0
    log_every: PositiveInt = 10
    checkpoint_every: NonNegativeInt = 0  # 0: only at the end
    checkpoint_dir: str | None = None  # None: no checkpoints
    resume: bool = True  # continue from checkpoint_dir/latest when it exists
    # On resume with another `steps` (or warmup_steps): false keeps the checkpoint's lr
    # schedule (no jump); true re-spreads the cosine over the new `steps`, as a run with
    # them from the start would have it. Either way one line says what it does.
    reschedule: bool = False
    # Stop after this many steps of this run (saving a checkpoint), as Megatron's
    # --exit-interval: lets a job fit a time slot; the schedule still spans `steps`.
    exit_after_steps: PositiveInt | None = None
    peak_flops: float | None = Field(default=None, gt=0)  # per device, for MFU
    trace_dir: str | None = None  # per-rank Chrome traces of the last logged step
    # Every eval_every steps and after the last, the mean loss over eval_batches global
    # batches of data.eval (0: no evaluation).
    eval_every: NonNegativeInt = 0
    eval_batches: PositiveInt = 4
    profile: ProfileWindow | None = None  # torch.profiler over chosen steps

    @model_validator(mode="after")
    def _bf16_spelling(self) -> TrainSection:
        if self.bf16 and self.precision == "fp16":
            raise ValueError("train.bf16 is true and train.precision is fp16: keep one "
                             "(bf16: true is the older spelling of precision: bf16)")
        if self.bf16 and self.precision == "fp32":
            object.__setattr__(self, "precision", "bf16")
        return self


class EvalData(_Section):
    """Held-out data for ``train.eval_every``: the last ``fraction`` of the packed rows,
    taken out before the training order is drawn (training never sees them), or its own
    ``source`` (read with the training data's format, text field and tokenizer)."""

    fraction: float = Field(default=0.0, ge=0, lt=1)
    source: str | None = None


class DataSection(_Section):
    """``source``: ``stdlib`` (the running interpreter's standard-library sources), a
    text or JSONL file, a directory of them, a ``datasets`` dataset saved to disk, or a
    directory ``paraxis data prepare`` wrote (memory-mapped tokens); with ``streaming``,
    parquet, arrow or JSONL files read as they train (:mod:`paraxis.train.stream`).

    ``format``: what a row is, ``text`` or a fine-tuning example whose answers alone
    score by default, ``prompt_response`` or ``chat`` (:mod:`paraxis.train.sft`)."""

    source: str = "stdlib"
    format: Literal["text", "prompt_response", "chat"] = "text"
    # How the source is stored (auto: told from the path). Before issue 34 this was
    # ``format``; ``format: jsonl | hf_disk | tokens | auto`` is still read as it.
    source_format: Literal["auto", "text", "jsonl", "hf_disk", "tokens"] = "auto"
    text_field: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    # Which tokens score: the responses / assistant turns, or all (None: answers for
    # prompt_response and chat; text has no answers).
    loss_on: Literal["answers", "all"] | None = None
    tokenizer: str = "bytes"  # or the path of a local Hugging Face tokenizer
    max_bytes: PositiveInt = 8_000_000
    shuffle: bool = True
    # Packed rows carry position ids restarting after each separator, so no token attends
    # to another document and no target crosses a boundary. Off by default: pretraining
    # on concatenated text usually attends across. Fine-tuning formats are always apart.
    document_masking: bool = False
    # Read the source as it trains (paraxis.train.stream): local parquet, arrow or JSONL
    # files streamed by ``datasets``, tokenized and packed on the fly, so a rank holds a
    # few chunks whatever the corpus size. The stream is cut into ``stream_shards``
    # (default: data x expert at the start) which ranks divide among themselves; a resume
    # on data x expert that divides it continues exactly, any other is refused.
    streaming: bool = False
    stream_shards: PositiveInt | None = None
    # One document per row, cut at seq_length and right-padded, instead of packing; with
    # balance_tokens each global batch's rows go to ranks by real tokens (largest first).
    packing: bool = True
    balance_tokens: bool = False
    eval: EvalData = EvalData()

    @model_validator(mode="before")
    @classmethod
    def _older_format_spelling(cls, raw: Any) -> Any:
        """``format`` named how the source is stored before it named what a row is."""
        if isinstance(raw, Mapping) and raw.get("format") in ("auto", "jsonl", "hf_disk",
                                                               "tokens"):
            if "source_format" in raw:
                raise ValueError(f"data.format {raw['format']!r} is the older spelling of "
                                 "data.source_format, which is set too: keep one")
            raw = {**raw, "source_format": raw["format"], "format": "text"}
        return raw

    @property
    def finetuning(self) -> bool:  # rows are prompt_response or chat examples
        return self.format != "text"

    @property
    def answers_only(self) -> bool:
        """Only the answers score (``loss_on``, with its default)."""
        return (self.loss_on or ("answers" if self.finetuning else "all")) == "answers"

    def check_rows(self) -> list[Problem]:
        """What this section asks of a row that cannot be honoured, found without data."""
        problems = []
        if self.loss_on == "answers" and not self.finetuning:
            problems.append(Problem(
                "data.loss_on", "answers", "format text has no answers: every token of a "
                "document is a target", "set data.format: prompt_response or chat (with "
                "its fields), or drop data.loss_on"))
        if self.finetuning and "document_masking" in self.model_fields_set \
                and not self.document_masking:
            problems.append(Problem(
                "data.document_masking", False, f"format {self.format} keeps its examples "
                "apart in a packed row (an answer never attends to another example)",
                "drop data.document_masking, or set data.packing: false"))
        return problems


class RunConfig(ParallelConfig):
    model: ModelSection = ModelSection()
    train: TrainSection = TrainSection()
    data: DataSection = DataSection()
    logging: LoggingSection = LoggingSection()
    lora: LoraSection | None = None  # adapters through peft (paraxis.config.lora)

    @classmethod
    def load(cls, path: str | os.PathLike[str], overrides: Sequence[str] = (),
             env: Mapping[str, str] | None = None) -> RunConfig:
        """Read YAML (with ``${VAR}`` expansion), apply ``a.b=value`` overrides and check
        types. Cross-field rules are :meth:`check_run` and
        :func:`paraxis.config.rules.validate`; the CLI reports them all together."""
        raw = read_config(path, os.environ if env is None else env)
        apply_overrides(raw, overrides)
        return cls.from_dict(raw)

    def check_run(self) -> list[Problem]:
        t, mbs = self.train, self.schedule.microbatches
        problems = []
        if t.global_batch % (self.sample_shards * mbs):
            problems.append(Problem(
                "train.global_batch", t.global_batch,
                f"must split evenly over data x expert = {self.sample_shards} ranks and "
                f"{mbs} microbatches", f"use a multiple of {self.sample_shards * mbs}"))
        if t.warmup_steps > t.steps:
            problems.append(Problem("train.warmup_steps", t.warmup_steps,
                                    f"exceeds train.steps = {t.steps}",
                                    "shorten the warmup"))
        held_out = self.data.eval
        if t.eval_every and not (held_out.fraction or held_out.source):
            problems.append(Problem("train.eval_every", t.eval_every,
                                    "needs held-out data, and data.eval names none",
                                    "set data.eval.fraction (e.g. 0.05) or "
                                    "data.eval.source"))
        window = t.profile
        if window is not None and window.start + window.steps - 1 > t.steps:
            problems.append(Problem("train.profile", window.model_dump(exclude_none=True),
                                    f"ends after the last step (train.steps = {t.steps})",
                                    f"start it at step {max(1, t.steps - window.steps + 1)} "
                                    "or earlier"))
        if held_out.fraction and held_out.source:
            problems.append(Problem("data.eval", held_out.model_dump(),
                                    "names both a fraction and a source",
                                    "keep one of data.eval.fraction and data.eval.source"))
        return problems

    def check_data_modes(self) -> list[Problem]:
        """Combinations of the data section's modes that cannot be honoured (reported by
        :func:`paraxis.train.data.check_data`, which ``train()`` runs before any process
        group as the CLI does before any process)."""
        d, problems = self.data, []
        if d.streaming:
            if d.source == "stdlib" or d.source_format not in ("auto", "jsonl"):
                problems.append(Problem("data.streaming", True, f"streams local parquet, "
                                        f"arrow or JSONL files, not source {d.source!r} "
                                        f"stored as {d.source_format!r}", "point data."
                                        "source at such files or a directory of them"))
            if d.eval.fraction:
                problems.append(Problem("data.eval.fraction", d.eval.fraction,
                                        "a stream has no end to hold rows out from",
                                        "give data.eval.source instead"))
            if not d.packing:
                problems.append(Problem("data.packing", False, "a stream packs its rows",
                                        "set data.packing: true or data.streaming: false"))
        shards = d.stream_shards
        if shards is not None and (shards % self.sample_shards or
                                   self.train.global_batch % shards):
            problems.append(Problem("data.stream_shards", shards, f"must be a multiple of "
                                    f"data x expert = {self.sample_shards} and divide "
                                    f"train.global_batch = {self.train.global_batch}",
                                    f"use {self.sample_shards}"))
        if d.balance_tokens and d.packing:
            problems.append(Problem("data.balance_tokens", True, "packed rows are all "
                                    "full: there is nothing to balance",
                                    "set data.packing: false"))
        if not d.packing and (d.eval.fraction or d.eval.source):
            problems.append(Problem("data.eval", d.eval.model_dump(), "unpacked rows do "
                                    "not evaluate yet", "keep data.packing: true for eval"))
        return problems
