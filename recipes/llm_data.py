"""Pretrain / instruct / conversation JSON for the llama pipeline: token ids and labels that put
the loss only on what the model should learn to write.

    python -m recipes.llm_data --make-example data/example_llm.json     (a tiny file, by code)

Formats (a JSON list, or one JSON object per line), detected from the first record's keys:
  pretrain       {"text": "..."}                                      loss on every token
  instruct       {"instruction": "...", "input": "...", "output": "..."}  loss on the output only
  conversation   {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}, ...]}
                 loss on the "gpt"/"assistant" turns only
Tokens: UTF-8 bytes (vocabulary 256: the "tiny" llama preset's), or any tokenizer with encode().
Labels follow HF's causal-LM convention (llama_loss shifts them): label = the token itself where
the loss counts, −100 elsewhere and on padding. Every sample is cut or padded (pad id 0) to
`seq` tokens — a pipeline boundary has one shape. Cost: one pass over the text.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from primitives.log import console

IGNORE = -100
USER_ROLES, BOT_ROLES = ("human", "user"), ("gpt", "assistant")


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def read_records(path: str) -> list[dict]:
    with open(path) as f:
        text = f.read().strip()
    return json.loads(text) if text.startswith("[") else [json.loads(line) for line in text.splitlines() if line.strip()]


def detect(record: dict) -> str:
    if "conversations" in record:
        return "conversation"
    if "instruction" in record and "output" in record:
        return "instruct"
    if "text" in record:
        return "pretrain"
    raise ValueError(f"record keys {sorted(record)} match no format; expected 'text' (pretrain), "
                     "'instruction' + 'output' (instruct) or 'conversations' (conversation)")


def pieces(record: dict, fmt: str) -> list[tuple[str, bool]]:
    """(text, counts in the loss) in order."""
    if fmt == "pretrain":
        return [(record["text"], True)]
    if fmt == "instruct":
        prompt = record["instruction"] + ("\n" + record["input"] if record.get("input") else "")
        return [(f"### Instruction:\n{prompt}\n### Response:\n", False), (record["output"] + "\n", True)]
    out = []
    for turn in record["conversations"]:
        who = turn["from"].lower()
        if who not in USER_ROLES + BOT_ROLES + ("system",):
            raise ValueError(f"conversation turn from {turn['from']!r}; expected one of {USER_ROLES + BOT_ROLES}")
        bot = who in BOT_ROLES
        out.append((("### Assistant:\n" if bot else "### User:\n"), False))
        out.append((turn["value"] + "\n", bot))
    return out


def encode(record: dict, fmt: str, seq: int, tok=None) -> tuple[torch.Tensor, torch.Tensor]:
    tok = tok or ByteTokenizer()
    ids, labels = [], []
    for text, learn in pieces(record, fmt):
        t = tok.encode(text)
        ids += t
        labels += t if learn else [IGNORE] * len(t)
    ids, labels = ids[:seq], labels[:seq]
    pad = seq - len(ids)
    return torch.tensor(ids + [0] * pad), torch.tensor(labels + [IGNORE] * pad)


def load_dataset(path: str, seq: int, fmt: str | None = None, tok=None) -> torch.utils.data.TensorDataset:
    records = read_records(path)
    if not records:
        raise ValueError(f"{path}: no records")
    fmt = fmt or detect(records[0])
    pairs = [encode(r, fmt, seq, tok) for r in records]
    empty = [i for i, (_, y) in enumerate(pairs) if int((y[1:] != IGNORE).sum()) == 0]
    if empty:
        raise ValueError(f"{path}: records {empty[:5]} ({len(empty)} in all) keep no answer token within seq={seq} "
                         "tokens (the loss would be 0/0); raise --seq or shorten their prompts")
    return torch.utils.data.TensorDataset(torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]))


def make_example(path: str, n: int = 64) -> str:
    """A tiny instruct + conversation file: arithmetic questions with their answers."""
    recs = []
    for i in range(n):
        a, b = i % 9 + 1, (7 * i) % 9 + 1
        if i % 2:
            recs.append({"instruction": f"What is {a} plus {b}?", "input": "", "output": f"{a} plus {b} is {a + b}."})
        else:
            recs.append({"conversations": [{"from": "human", "value": f"Add {a} and {b}."},
                                           {"from": "gpt", "value": f"{a + b}."}]})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(json.dumps(r) for r in recs if "instruction" in r) + "\n")
    conv = os.path.splitext(path)[0] + "_conversation.json"
    with open(conv, "w") as f:
        json.dump([r for r in recs if "conversations" in r], f)
    return path


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--make-example", required=True, help="path of the instruct file (a *_conversation.json beside it)")
    out = make_example(ap.parse_args().make_example)
    console.print(f"wrote {out} and {os.path.splitext(out)[0]}_conversation.json")
