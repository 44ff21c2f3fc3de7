"""DeepSeek's sparse attention (DSA) under context parallelism (paraxis_seq.indexed):
tiny DeepSeek-V3.2 and GLM-MoE-DSA (a shared layer reusing the previous selection) in
float64, two ranks by ring (zigzag) and Ulysses (contiguous), against one process's
loss and every parameter's gradient. The selection keeps 4 of 16 keys, so a selection
made from a rank's shard, in the wrong order or not applied changes the loss (the plants
reported in the commit that added this file)."""

import copy

import pytest
import torch
import torch.distributed as dist

from paraxis.parallel.batch import DOC_IDS_KWARG
from paraxis.runtime.collectives import CommStats, all_reduce_
from paraxis.runtime.grid import AxisGroup, Grid
from paraxis.testing.tolerance import FP64_RTOL
from paraxis_seq.hf_attention import attention_function, interceptable, use_context_attention
from paraxis_seq.zigzag import shard

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

SEQ = 16
MLA = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, vocab_size=64,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
           n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=8, q_lora_rank=16,
           qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, head_dim=4,
           max_position_embeddings=64, index_topk=4, index_head_dim=8, index_n_heads=2,
           mlp_layer_types=["dense", "dense"], attention_dropout=0.0,
           layer_types=["indexed_attention"] * 2)
FAMILIES = {
    "deepseek_v32": dict(n_group=1, topk_group=1),
    "glm_moe_dsa": dict(indexer_types=["full", "shared"]),
}


def tiny(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)  # SDPA: eager's softmax runs in float32, the kernels' in float64
    cfg = AutoConfig.for_model(family, attn_implementation="sdpa", **MLA, **FAMILIES[family])
    return AutoModelForCausalLM.from_config(cfg).double().train()


def _loss(model, ids, pos, targets, count, **docs):
    logits = model(input_ids=ids, position_ids=pos, use_cache=False, **docs).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                             reduction="sum") / count


def check_sharded(family, mode, packed=False):
    """Per rank: one process's loss and gradients, then this rank's shard's. ``packed``:
    two documents per row (7 + 9 tokens, positions restarting), which transformers masks
    from the positions and the context ranks from document ids."""
    grid = Grid.build({"context": dist.get_world_size()})
    group = grid.group("context")
    ref = tiny(family)
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(3))
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    count, pos = (targets != -100).sum(), torch.arange(SEQ).expand_as(ids)
    docs = torch.zeros_like(ids)
    if packed:
        pos = torch.cat([torch.arange(7), torch.arange(SEQ - 7)]).expand_as(ids)
        docs[:, 7:], targets[:, 6] = 1, -100
        count = (targets != -100).sum()
    loss = _loss(ref, ids, pos, targets, count)
    loss.backward()
    cp = copy.deepcopy(ref)
    cp.zero_grad()
    layout = "zigzag" if mode == "ring" else "contiguous"
    use_context_attention(cp, group, mode=mode, layout=layout)
    cut = dict(size=group.size, rank=group.rank, layout=layout)
    extra = {DOC_IDS_KWARG: shard(docs, **cut)} if packed else {}
    part = _loss(cp, shard(ids, **cut), shard(pos, **cut), shard(targets, **cut), count,
                 **extra)
    part.backward()
    total = part.detach().clone()
    all_reduce_(total, group)
    grad_err, learned = 0.0, 0
    for p, q in zip(ref.parameters(), cp.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None)  # the indexer's weights learn nothing
        if p.grad is None:
            continue
        g = q.grad.clone()
        all_reduce_(g, group)
        err = (g - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30)
        grad_err, learned = max(grad_err, float(err)), learned + 1
    out = {"loss": abs(float(total) / float(loss) - 1), "grads": grad_err, "learned": learned}
    grid.destroy()
    return out


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dsa_two_ranks_match_one_process(worlds, family, mode):
    for res in worlds.run(2, check_sharded, family, mode):  # relative errors, float64
        assert res["loss"] < 1e-14 and res["grads"] < 1e-12 and res["learned"] > 10, res


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_dsa_packed_documents(worlds, mode):
    for res in worlds.run(2, check_sharded, "deepseek_v32", mode, True):
        assert res["loss"] < 1e-14 and res["grads"] < 1e-12, res


def test_selection_matters():
    """The test's selection changes the model: attending every causal key instead gives
    another loss (else a lost selection would pass the parity test)."""
    model = tiny("deepseek_v32")
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(SEQ).expand_as(ids)
    sparse = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    model.config.index_topk = SEQ
    for m in model.modules():
        if hasattr(m, "index_topk"):
            m.index_topk = SEQ
    dense = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert float((sparse - dense).abs().max().detach()) > 1e-3


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_one_process_matches_sdpa(mode):
    """A context group of one (registered twice: a new grid rebinds the wrapper)."""
    model = tiny("glm_moe_dsa")
    assert interceptable(model) is None
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(SEQ).expand_as(ids)
    want = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    for _ in range(2):
        use_context_attention(model, _alone(), mode=mode)
    got = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=FP64_RTOL, atol=FP64_RTOL)


def _alone():
    return AxisGroup(("context",), (0,), 0, None, CommStats())


def test_indices_of_a_shard_refused():
    two = AxisGroup(("context",), (0, 1), 0, None, CommStats())
    fn = attention_function(two, mode="ring")  # two ranks: 4 local queries are 8 in all
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="ranked only this rank's shard"):
        fn(torch.nn.Module(), q, q, q, None, indices=torch.zeros(1, 4, 2, dtype=torch.int32))
