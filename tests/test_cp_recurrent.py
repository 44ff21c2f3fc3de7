"""Recurrent layers under context parallelism (issue 35) through ``parallelize``, against
one process: per-parameter first-step gradients, 20 steps of losses and gradient
norms, an evaluation loss and the final weights at the shared tolerance
(tests/hf_parity.py, paraxis.testing.tolerance), fp32.

Each rank runs its chunks of every Mamba / gated-delta-rule / convolution layer from a
zero state and passes the boundary state (and the convolution's last inputs) across
ranks (paraxis_seq.recurrent). Families: Bamba and Nemotron-H (Mamba-2 hybrids with
attention; Nemotron-H with MoE and MLP layers), Qwen3-Next (gated delta rule, MoE),
Mamba (a pure Mamba-1 SSM); MiniMax (lightning attention), RecurrentGemma (a
convolution and the RG-LRU) and ZAYA (convolutions in its attention's projection), whose
recurrences run in their modules' own forward
(paraxis_seq.state_inline). Debug models (paraxis_hf.debug): hidden 32, 2 to 4 layers.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from hf_parity import compare

import paraxis
from paraxis.config.errors import ConfigError
from paraxis.engine.probe import ParityError
from paraxis.testing.parity import assemble, assert_same_gradients, local_gradients
from paraxis.testing.tolerance import STEP_RTOL, assert_losses_close, gradient_errors
from paraxis_hf import build_debug_model
from paraxis_seq.recurrent import ModelCall

STEPS, SEQ, BATCH = 20, 128, 4
FAMILIES = {
    # Bamba's init (dt = softplus(1) per token, A = -1..-4, D = 1, weights of std 0.02)
    # lets a state carry e^-40 across a 32-token chunk and gives the scan 1e-4 of the
    # mixer's output: parity would hold with no state passed. dt capped at 0.05 and
    # weights of std 0.1 carry it (a boundary state from the wrong rank: 2.5e-2 relative
    # gradient error, against 6e-7 passed right). Nemotron-H's dt cannot be capped (its
    # limit is (time_step_min, inf)): it checks the convolution halo and the wiring.
    "bamba": {"max_position_embeddings": SEQ, "time_step_limit": (0.0, 0.05),
              "initializer_range": 0.1},
    "nemotron_h": {"max_position_embeddings": SEQ},
    "qwen3_next": {"max_position_embeddings": SEQ},
    "mamba": {},
    # Recurrences run in the mixer's own forward (paraxis_seq.state_inline): MiniMax's
    # lightning attention and RecurrentGemma's convolution and RG-LRU. With no state
    # passed, parallelize's probe refuses both (MiniMax, context 2: a gradient 27% off;
    # RecurrentGemma: the loss 8e-4 off); passed, gradients agree to 6e-7.
    "minimax": {"max_position_embeddings": SEQ},
    "recurrent_gemma": {"max_position_embeddings": SEQ},
    # ZAYA's attention projection convolves q/k over the 2 tokens before and takes half
    # of each value from the one before (without that halo the probe refuses).
    "zaya": {"max_position_embeddings": SEQ},
}
LAYOUTS = [
    pytest.param({"context": 2}, {}, id="ring2"),
    pytest.param({"context": 4}, {}, id="ring4"),
    # Ulysses: attention's heads split (4 over 2), recurrent layers pass their state over
    # contiguous shards; Mamba has no attention, only the layout differs.
    pytest.param({"context": 2}, {"context_mode": "ulysses"}, id="ulysses2"),
]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("degrees", "options"), LAYOUTS)
def test_recurrent_context_matches_one_process(worlds, family, degrees, options):
    compare(worlds, family, degrees, overrides=FAMILIES[family], steps=STEPS, seq=SEQ,
            batch=BATCH, **options)


def test_state_passing_under_recomputation(worlds):
    """Full activation checkpointing recomputes each layer in backward: the wrapped mixer
    runs again, with its all-gathers, on every rank alike (Bamba, context 2)."""
    compare(worlds, "bamba", {"context": 2}, overrides=FAMILIES["bamba"], steps=STEPS,
            seq=SEQ, batch=BATCH, activation_checkpointing="full")


def test_state_passing_in_bf16(worlds):
    """bf16 with plain SGD against one process in bf16 (the precision tolerances,
    weights after the steps): states and transitions are exchanged in the dtype the
    model's kernels return them in, not cast (Qwen3-Next, context 2)."""
    compare(worlds, "qwen3_next", {"context": 2}, overrides=FAMILIES["qwen3_next"], steps=8,
            seq=SEQ, batch=BATCH, recipe={"precision": "bf16", "optimizer": "sgd"})


@pytest.mark.parametrize(("degrees", "options"), [
    pytest.param({"context": 2, "tensor": 2}, {"sequence_parallel": True}, id="tensor2-sp"),
    pytest.param({"context": 2, "pipeline": 2}, {"microbatches": 2}, id="pipeline2"),
])
def test_state_passing_composes(worlds, degrees, options):
    """Qwen3-Next (gated delta rule, attention, MoE): under tensor 2 + SP each tensor rank
    passes the states of its own heads, gathered from the sequence-parallel shards; under
    pipeline 2 each stage wraps the mixers it holds, per microbatch."""
    compare(worlds, "qwen3_next", degrees, overrides=FAMILIES["qwen3_next"], steps=STEPS,
            seq=SEQ, batch=BATCH, **options)


# ---- packed documents: the state resets where a document starts --------------------

DOC_SEQ, DOC_VOCAB = 16, 128
# Documents per packed row: starts inside a rank's chunk (5, 9, 3), on a chunk's edge
# (12: zigzag over 2 ranks cuts at 4, 8, 12; 8: contiguous shards over 2 cut there too)
# and none (16); one shorter than the convolution's 4 taps (3).
DOC_ROWS = ((5, 7, 4), (9, 7), (3, 6, 7), (16,), (8, 8))


def packed_and_padded():
    """The packed rows, and the same documents one per right-padded row without a mask
    (labels -100 at the pads): exact under causal mixers, and what one process can run
    (a recurrent family does not honour packed positions itself)."""
    g = torch.Generator().manual_seed(11)
    ids, pos, docs = [], [], []
    for lengths in DOC_ROWS:
        row = [torch.randint(1, DOC_VOCAB, (n,), generator=g) for n in lengths]
        docs += row
        ids.append(torch.cat(row))
        pos.append(torch.cat([torch.arange(n) for n in lengths]))
    padded = torch.zeros(len(docs), DOC_SEQ, dtype=torch.long)
    labels = torch.full_like(padded, -100)
    for i, d in enumerate(docs):
        padded[i, :len(d)] = labels[i, :len(d)] = d
    return ({"input_ids": torch.stack(ids), "position_ids": torch.stack(pos)},
            {"input_ids": padded, "labels": labels})


# The reference pads each document to a row of its own, and a router's load-balancing
# loss counts pad tokens: Qwen3-Next's packed and padded rows agree only without it.
DOC_OVERRIDES = {"bamba": {}, "qwen3_next": {"router_aux_loss_coef": 0.0}, "mamba": {},
                 "minimax": {"router_aux_loss_coef": 0.0}, "recurrent_gemma": {}, "zaya": {}}


def documents_run(family, degrees, packed):
    """(eval loss, this rank's first gradients) of the packed rows (or, ``packed`` False,
    the padded ones), its share of them where samples are split; where a step refuses,
    its message."""
    batch = packed_and_padded()[0 if packed else 1]
    model = build_debug_model(family, **FAMILIES[family], **DOC_OVERRIDES[family])
    engine = paraxis.parallelize(model, **degrees, train={"seq_length": DOC_SEQ})
    index, count = engine.grid.sample_shard()
    rows = batch["input_ids"].shape[0]
    share = {k: v[index * rows // count:(index + 1) * rows // count] for k, v in batch.items()}
    try:
        out = engine.eval_step(share), local_gradients(engine, share)
    except ValueError as exc:
        out = str(exc)
    engine.close()
    return out


@pytest.mark.parametrize(("family", "mode"), [("bamba", "ring"), ("bamba", "ulysses"),
                                              ("qwen3_next", "ring"), ("mamba", "ring"),
                                              ("minimax", "ring"), ("recurrent_gemma", "ring")])
def test_packed_documents_reset_the_state(worlds, family, mode):
    """Packed rows under context 2 give the loss and every parameter's gradient of their
    documents run one per padded row in one process (Bamba: Mamba-2 and its convolution;
    Qwen3-Next: the gated delta rule; Mamba, whose layers call their mixer without
    keywords: the ids of the model call reach it); one process cannot take the packed rows itself
    (its recurrent layers would carry the state across documents)."""
    ((want, ref_grads),) = worlds.run(1, documents_run, family, {}, False)
    out = worlds.run(2, documents_run, family, {"context": 2, "context_mode": mode}, True)
    for loss, _ in out:
        assert_losses_close([loss], [want], "packed rows against one document per row")
    assert_same_gradients([g for _, g in out], ref_grads)


def test_packed_rows_are_refused_where_a_convolution_cannot_reset(worlds):
    """ZAYA's projection passes its halo over full rows only: packed rows under context
    2 refuse at the step, naming why, rather than convolve across a document's start."""
    out = worlds.run(2, documents_run, "zaya", {"context": 2}, True)
    assert all(isinstance(o, str) and "neither a cache nor padded or packed rows" in o
               for o in out), out


def test_a_recomputation_under_a_pipeline_refuses_the_model_calls_ids():
    """Mixers their family calls without keywords (Mamba's) take the document ids of
    the model call that runs them (paraxis_seq.recurrent.ModelCall); in backward under a
    pipeline schedule that call may be another microbatch's, so it refuses there, and
    takes them everywhere else."""
    ids = torch.zeros(2, 4)
    hidden = torch.ones(2, 4, 3, requires_grad=True)
    seen = {}

    def in_backward(call, grad):
        try:
            seen[call.pipelined] = call.documents("MambaMixer", hidden)
        except ValueError as exc:
            seen[call.pipelined] = str(exc)
        return grad

    for pipelined in (False, True):
        call = ModelCall(pipelined)
        call.ids = ids
        assert call.documents("MambaMixer", hidden) is ids  # in the forward
        out = hidden * 2
        out.register_hook(lambda grad, call=call: in_backward(call, grad))
        out.sum().backward()
    assert seen[False] is ids
    assert isinstance(seen[True], str), seen[True]
    assert "recomputed in backward under a pipeline schedule" in seen[True], seen[True]
    with pytest.raises(ValueError, match=r"do not cover its input \(2, 5\)"):
        call.documents("MambaMixer", torch.ones(2, 5, 3))


def one_process_refuses_packed_rows():
    engine = paraxis.parallelize(build_debug_model("bamba", **FAMILIES["bamba"]),
                                 train={"seq_length": DOC_SEQ})
    try:
        engine.eval_step(packed_and_padded()[0])
    except ValueError as exc:
        return str(exc)
    finally:
        engine.close()
    return None


def test_one_process_refuses_what_context_keeps_apart(worlds):
    (why,) = worlds.run(1, one_process_refuses_packed_rows)
    assert why is not None and "packed-document boundaries" in why, why


# ---- planted: a boundary state from the wrong rank ---------------------------------

@contextlib.contextmanager
def states_from_the_next_rank():
    """Plant: every chunk's boundary state and transition read as the next rank sent
    its own (the all-gather's blocks rotated by one rank); the convolutions' inputs are
    exchanged right (state_kernels holds its own reference to gather_chunks)."""
    import paraxis_seq.state_exchange as exchange

    real = exchange.gather_chunks

    def rotated(parts, chunks, *, grad=True):
        ordered = real(parts, chunks, grad=grad)
        size, held = chunks.group.size, chunks.held
        out = list(ordered)
        for r in range(size):
            sent = [ordered[k] for k in held((r + 1) % size)]
            for k, t in zip(held(r), sent, strict=True):
                out[k] = t
        return out

    exchange.gather_chunks = rotated
    try:
        yield
    finally:
        exchange.gather_chunks = real


def planted_gradients(degrees, plant, before):
    """First-step gradients of Bamba under ``degrees``, the plant installed after
    ``parallelize`` (its parity probe saw the true exchange) unless ``before``; where
    the probe refuses, its message."""
    model = build_debug_model("bamba", **FAMILIES["bamba"])
    with contextlib.ExitStack() as stack:
        if plant and before:
            stack.enter_context(states_from_the_next_rank())
        try:
            engine = paraxis.parallelize(model, **degrees, train={"seq_length": SEQ})
        except ParityError as exc:
            return str(exc)
        if plant and not before:
            stack.enter_context(states_from_the_next_rank())
        ids = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
        grads = local_gradients(engine, {"input_ids": ids})
        engine.close()
        return grads


def test_a_boundary_state_from_the_wrong_rank_fails(worlds):
    """Context 2: the planted exchange changes Bamba's gradients far past the tolerance
    the true one meets (per-parameter first-step gradients), and parallelize's parity
    probe refuses the planted layout."""
    (want,) = worlds.run(1, planted_gradients, {}, False, False)
    got = worlds.run(2, planted_gradients, {"context": 2}, False, False)
    assert_same_gradients(got, want)
    planted = worlds.run(2, planted_gradients, {"context": 2}, True, False)
    errors = gradient_errors(assemble(planted), assemble([want]))
    worst = max(errors, key=errors.get)
    print(f"planted: worst gradient error {errors[worst]:.2e} ({worst})")
    assert errors[worst] > 100 * STEP_RTOL, (worst, errors[worst])
    refused = worlds.run(2, planted_gradients, {"context": 2}, True, True)
    assert all(isinstance(r, str) for r in refused), refused


# ---- bad input: a recurrence no kernel boundary lets paraxis pass -------------------

def test_a_state_that_cannot_be_passed_is_refused_before_any_process_group():
    """xLSTM's mLSTM computes its recurrence in the module's own code, with no method
    or state paraxis could hand it: parallelize refuses it from the module alone, naming
    the module and why, with no process group created (one process, no ``worlds``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "xlstm", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_heads=4,
            chunk_size=8))
    with pytest.raises(ConfigError) as err:
        paraxis.parallelize(model, context=2, train={"seq_length": SEQ})
    text = str(err.value)
    for part in ("parallelism.context", "(backbone.blocks",
                 "not through a kernel function", "without the context axis"):
        assert part in text, text
    assert not dist.is_initialized()
