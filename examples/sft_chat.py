"""Stand-ins for ``examples/sft_chat.yaml``: a saved small Llama, its tokenizer with a chat
template, and a chat JSONL, written under ``runs/sft_chat`` (or the directory given).

    python examples/sft_chat.py                      # writes runs/sft_chat/...
    paraxis train --config examples/sft_chat.yaml    # answers-only loss, data 2
    paraxis checkpoint export-hf runs/sft_chat/checkpoints runs/sft_chat/hf
    python examples/sft_chat.py --ask "add two and five" runs/sft_chat/hf

With your own model, point ``model.pretrained`` and ``data.tokenizer`` at its
``save_pretrained`` directory and ``data.source`` at JSONL rows of
``{"messages": [{"role": ..., "content": ...}, ...]}``; nothing else changes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write_stand_ins(root: Path, rows: int = 800, seed: int = 0) -> None:
    import torch

    from paraxis.testing.chat import chat_rows, write_tokenizer
    from paraxis_hf import build_causal_lm

    tokenizer = write_tokenizer(root / "tokenizer")  # a template with {% generation %}
    with (root / "chat.jsonl").open("w") as f:
        for row in chat_rows(rows):
            f.write(json.dumps(row) + "\n")
    # A model built from config keeps Llama's default token ids (bos 1, eos 2), not the
    # tokenizer's: export-hf sets them from the tokenizer the run used.
    torch.manual_seed(seed)
    model = build_causal_lm("llama", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "max_position_embeddings": 128, "tie_word_embeddings": False})
    assert len(tokenizer) <= model.config.vocab_size
    model.save_pretrained(str(root / "model"))
    print(f"wrote {root}/model, {root}/tokenizer and {root}/chat.jsonl ({rows} rows)")


def ask(exported: Path, question: str) -> str:
    """The exported model's answer, greedy; generate stops at the tokenizer's EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(exported))
    model = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": question}],
                                     add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    return tok.decode(out[0, prompt["input_ids"].shape[1]:])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="runs/sft_chat", type=Path)
    parser.add_argument("--ask", help="a question for the exported model in ROOT")
    args = parser.parse_args()
    if args.ask:
        print(ask(args.root, args.ask))
    else:
        write_stand_ins(args.root)
