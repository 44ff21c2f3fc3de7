"""Fine-tuned weights out (issue 34, item 3 and the example): ``examples/sft_chat.yaml``
trained as shipped (data 2) on the stand-ins ``examples/sft_chat.py`` writes, then
``paraxis checkpoint export-hf``: ``from_pretrained`` on the export gives the run's last
eval loss on the same held-out rows (transformers' own loss with the rows' labels and
position ids), the run's tokenizer is in the directory, the config and generation
config carry its bos/eos/pad ids (the saved Llama said 1 and 2, Llama's defaults), and
``generate`` stops at the tokenizer's EOS after the answer."""

import importlib.util
from pathlib import Path

import pytest
import torch

from paraxis.cli.main import main
from paraxis.config.run import RunConfig
from paraxis.testing.tolerance import STEP_RTOL

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["add two and five", "add nine and nine", "add three and zero"]


def example_config(root, example_yaml="sft_chat.yaml", *overrides):
    """An example's config on the stand-ins ``examples/sft_chat.py`` writes in ``root``."""
    spec = importlib.util.spec_from_file_location("sft_chat", ROOT / "examples/sft_chat.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.write_stand_ins(root)
    return RunConfig.load(ROOT / "examples" / example_yaml, [
        f"model.pretrained={root}/model", f"data.source={root}/chat.jsonl",
        f"data.tokenizer={root}/tokenizer", f"train.checkpoint_dir={root}/checkpoints",
        *overrides, "logging.wandb=false", "logging.progress=false"], env={})


def train_example(cfg):
    from paraxis.train.loop import train

    return train(cfg)["eval_loss"]


def held_out_loss(model, cfg, tokenizer):
    """The mean over the first eval_batches global batches of the held-out rows of
    transformers' loss (the mean over the batch's answer tokens)."""
    from paraxis.train.data import split_held_out
    from paraxis.train.sources import rows_of

    _, held = split_held_out(cfg.data, cfg.train.seq_length, tokenizer, rows_of(cfg.data))
    size, losses = cfg.train.global_batch, []
    with torch.no_grad():
        for b in range(cfg.train.eval_batches):
            batch = held[torch.arange(b * size, (b + 1) * size)]
            losses.append(float(model(**batch, use_cache=False).loss))
    return sum(losses) / len(losses)


def test_the_example_exports_a_model_that_scores_and_stops_like_the_run(worlds, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paraxis.train.data import load_tokenizer

    cfg = example_config(tmp_path)
    assert cfg.degrees["data"] == 2
    run_eval = worlds.run(2, train_example, cfg)[0]
    out = tmp_path / "hf"
    assert main(["checkpoint", "export-hf", str(tmp_path / "checkpoints"), str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tok = AutoTokenizer.from_pretrained(str(out))  # the run's, written beside the weights
    assert tok.get_vocab() == load_tokenizer(cfg.data.tokenizer).hf.get_vocab()
    for config in (model.config, model.generation_config):
        assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
            tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) != (1, 2, None)
    exported = held_out_loss(model, cfg, load_tokenizer(str(out)))
    assert abs(exported - run_eval) <= STEP_RTOL * run_eval, (exported, run_eval)
    for question in QUESTIONS:
        prompt = tok.apply_chat_template([{"role": "user", "content": question}],
                                         add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)
        new = model.generate(**prompt, max_new_tokens=8, do_sample=False)[0, prompt[
            "input_ids"].shape[1]:].tolist()
        assert new[-1] == tok.eos_token_id and tok.eos_token_id not in new[:-1], (
            question, tok.convert_ids_to_tokens(new))
