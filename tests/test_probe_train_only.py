"""The parity probe of a model whose backward needs train mode (Reformer's reversible
layers assert ``training``): probed in train mode when that is the same function (no
dropout anywhere), the random streams left where they were; refused as before when a
dropout would make train mode another function."""

import pytest
import torch

pytest.importorskip("transformers")

from paraxis import ParallelConfig
from paraxis.engine.loss import causal_lm_loss_sum
from paraxis.engine.probe import Probe
from paraxis.parallel.batch import shift_labels
from paraxis.testing.tolerance import assert_losses_close

REFORMER = dict(attention_head_size=16, attn_layers=["local", "local"], axial_pos_shape=[4, 4],
                axial_pos_embds_dim=[16, 16], feed_forward_size=64, hidden_size=32,
                hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0,
                lsh_attention_probs_dropout_prob=0.0, local_attn_chunk_length=8,
                max_position_embeddings=16, num_attention_heads=2, vocab_size=64,
                is_decoder=True, num_buckets=4)


def _reformer(**overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        AutoConfig.for_model("reformer", **{**REFORMER, **overrides}))


def test_a_train_only_model_without_dropout_is_probed_in_train_mode():
    model = _reformer()
    state = torch.random.get_rng_state()
    probe = Probe.before(model, ParallelConfig.from_kwargs(data=2), seq_length=16, vocab=64,
                         forward_kwargs={})
    assert probe.train_mode and probe.grad_norm > 0
    assert torch.equal(torch.random.get_rng_state(), state)
    assert model.training  # modes restored
    with torch.no_grad():  # the same function as eval mode: no dropout
        loss_sum, count = causal_lm_loss_sum(model.eval()(probe.ids).logits,
                                             shift_labels(probe.ids))
    assert_losses_close([probe.loss], [float(loss_sum / count)], "train-mode probe loss")


def test_a_train_only_model_with_dropout_still_fails_the_probe():
    with pytest.raises(AssertionError, match="training mode"):
        Probe.before(_reformer(hidden_dropout_prob=0.1), ParallelConfig.from_kwargs(data=2),
                     seq_length=16, vocab=64, forward_kwargs={})
