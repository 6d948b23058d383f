"""Train a small T5 (built from config) on questions → SQL-like queries; report held-out exact match.

    torchrun --standalone --nproc_per_node 2 seq2seq/train.py --engine zero                  # ZeRO-1
    torchrun --standalone --nproc_per_node 2 seq2seq/train.py --engine zero \\
        --config seq2seq/ds_config_zero3_offload.json                                        # ZeRO-3 + nvme
    deepspeed --num_gpus 2 seq2seq/train.py --engine deepspeed                               # real DeepSpeed
    python -m seq2seq.memory_table                                                           # all four, one table

The task and vocabulary come from seq2seq/grammar.py (no downloads). T5: d_model 128, 2+2 layers,
4 heads, tied embeddings (~0.9 M parameters). Each rank takes its rows of every global batch;
evaluation greedy-decodes a fixed number of tokens (no early stop: under ZeRO-3 every rank must run
the same forwards) on its shard of the held-out set and exact matches are summed with one all-reduce.
"nvme_path": "auto" becomes OUTPUT_DIR/nvme. With --engine deepspeed an nvme section becomes
DeepSpeed's "cpu" offload (its nvme path needs libaio), said at start-up.
Output: OUTPUT_DIR/metrics.jsonl (loss every 50 steps, the final exact match, peak RSS per rank).
Cost per step and rank: forward+backward of 32 short pairs, plus the engine's traffic on ~0.9 M params.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import zero_from_scratch
from primitives.launch import init_from_env
from primitives.log import print0
from seq2seq.grammar import Vocab, dataset
from zero_from_scratch.engine.real_deepspeed import peak_rss_bytes, prepare_deepspeed

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_SRC, MAX_TGT = 32, 24


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="zero", choices=("deepspeed", "zero"))
    ap.add_argument("--config", "--deepspeed_config", dest="config", default=os.path.join(HERE, "ds_config_zero1.json"))
    ap.add_argument("--steps", type=int, default=1200, help="optimizer steps")
    ap.add_argument("--train-size", type=int, default=20000)
    ap.add_argument("--test-size", type=int, default=500)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--gradient-checkpointing", action="store_true", help="HF gradient_checkpointing_enable()")
    ap.add_argument("--tensorboard", default=None, metavar="DIR", help="the engine's monitor writes events to DIR")
    ap.add_argument("--output-dir", default="runs/seq2seq")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for k in ("steps", "train_size", "test_size", "d_model"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1, got {getattr(a, k)}")
    return a


def build_model(vocab: int, d_model: int):
    from transformers import T5Config, T5ForConditionalGeneration   # optional dependency: transformers
    cfg = T5Config(vocab_size=vocab, d_model=d_model, d_kv=d_model // 4, d_ff=2 * d_model, num_layers=2,
                   num_decoder_layers=2, num_heads=4, dropout_rate=0.0, tie_word_embeddings=True,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, use_cache=False)
    return T5ForConditionalGeneration(cfg)


def pad(rows, length):
    out = torch.zeros(len(rows), length, dtype=torch.long)
    for i, r in enumerate(rows):
        r = r[:length]
        out[i, :len(r)] = torch.tensor(r)
    return out


def batch(pairs, vocab):
    src = [vocab.encode(q) for q, _ in pairs]
    tgt = [vocab.encode(s) for _, s in pairs]
    x = pad(src, max(map(len, src)))
    y = pad(tgt, max(map(len, tgt)))
    y[y == 0] = -100                     # padding never counts in the loss
    return {"input_ids": x, "attention_mask": (x != 0).long(), "labels": y}


@torch.no_grad()
def exact_match(engine, test, vocab, rank, world, bs=100):
    """Greedy decoding, MAX_TGT tokens for every row (same forwards on every rank)."""
    engine.eval()
    mine = test[rank::world]
    n_batches = -(-len(test) // (world * bs))
    correct = 0
    for b in range(n_batches):
        rows = mine[b * bs:(b + 1) * bs] or test[:1]          # a rank with nothing left still runs the forwards
        x = pad([vocab.encode(q) for q, _ in rows], MAX_SRC)
        dec = torch.zeros(len(rows), 1, dtype=torch.long)
        for _ in range(MAX_TGT):
            logits = engine(input_ids=x, attention_mask=(x != 0).long(), decoder_input_ids=dec).logits
            dec = torch.cat([dec, logits[:, -1].argmax(-1, keepdim=True)], 1)
        if mine[b * bs:(b + 1) * bs]:
            correct += sum(vocab.decode(d[1:].tolist()) == s for d, (_, s) in zip(dec, rows))
    t = torch.tensor([correct], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(t)
    engine.train()
    return t.item() / len(test)


def resolve_config(path: str, a, out_dir: str, engine: str) -> tuple[dict, list[str]]:
    with open(path) as f:
        cfg = json.load(f)
    notes = []
    sp = cfg.get("scheduler", {}).get("params", {})
    if sp.get("total_num_steps") == "auto":
        sp["total_num_steps"] = a.steps
    z = cfg.get("zero_optimization", {})
    off = z.get("offload_optimizer")
    if off and off.get("device") == "nvme":
        if off.get("nvme_path") == "auto":
            off["nvme_path"] = os.path.join(out_dir, "nvme")
        if engine == "deepspeed":
            z["offload_optimizer"] = {"device": "cpu"}
            notes.append("deepspeed: offload_optimizer nvme → cpu (DeepSpeed's nvme needs libaio)")
    if a.tensorboard:
        cfg["tensorboard"] = {"enabled": True, "output_path": a.tensorboard, "job_name": engine}
    return cfg, notes


def main(argv=None):
    a = parse_args(argv)
    comm = init_from_env("gloo", 300.0)
    rank, world = comm.rank, comm.size
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    os.makedirs(a.output_dir, exist_ok=True)
    cfg, notes = resolve_config(a.config, a, a.output_dir, a.engine)
    for n in notes:
        print0(f"[yellow]{n}[/yellow]")
    vocab = Vocab()
    train, test = dataset(a.train_size, a.test_size, seed=a.seed)
    torch.manual_seed(a.seed)
    model = build_model(len(vocab.itos), a.d_model)
    if a.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if a.engine == "deepspeed":
        os.environ.setdefault("LOCAL_RANK", "0")
        engine, *_ = prepare_deepspeed().initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        engine, *_ = zero_from_scratch.initialize(model=model, config=cfg)
    micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg.get("gradient_accumulation_steps", 1)
    g = micro * gas * world
    stage = cfg.get("zero_optimization", {}).get("stage", 0)
    offload = cfg.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    label = f"{a.engine} ZeRO-{stage}" + (f" + {offload} offload" if offload != "none" else "")
    print0(f"{label}: T5 {sum(p.numel() for p in model.parameters()):,} params (before sharding), {world} ranks, "
           f"global batch {g}, {a.steps} steps, {len(train):,} train / {len(test)} held-out pairs")
    log = open(os.path.join(a.output_dir, "metrics.jsonl"), "w") if rank == 0 else None
    t0, losses, order = time.time(), [], torch.randperm(len(train), generator=torch.Generator().manual_seed(a.seed))
    pos = 0
    for step in range(1, a.steps + 1):
        for k in range(gas):
            if pos + g > len(order):
                order, pos = torch.randperm(len(train), generator=torch.Generator().manual_seed(a.seed + step)), 0
            rows = order[pos:pos + g][rank * micro * gas + k * micro:][:micro].tolist()
            loss = engine(**batch([train[i] for i in rows], vocab)).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        pos += g
        if step % 50 == 0 or step == a.steps:
            rec = {"step": step, "loss": sum(losses[-50:]) / len(losses[-50:]), "wall_s": time.time() - t0}
            print0(f"step {step:5d}  loss {rec['loss']:.4f}  {rec['wall_s']:.0f} s")
            if log:
                log.write(json.dumps(rec) + "\n")
                log.flush()
    train_s = time.time() - t0
    em = exact_match(engine, test, vocab, rank, world)
    rss = torch.tensor([peak_rss_bytes()], dtype=torch.int64)
    all_rss = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(all_rss, rss)
    res = {"config": label, "engine": a.engine, "stage": stage, "offload": offload, "exact_match": em,
           "train_s": train_s, "total_s": time.time() - t0, "steps": a.steps, "world_size": world,
           "peak_rss_per_rank": [int(x.item()) for x in all_rss], "final_loss": sum(losses[-50:]) / len(losses[-50:])}
    print0(f"held-out exact match {em:.3f} ({len(test)} pairs) after {train_s:.0f} s of training; peak RSS per rank "
           + ", ".join(f"{x / 2**20:,.0f} MiB" for x in res["peak_rss_per_rank"]))
    if log:
        log.write(json.dumps({"event": "final", **res}) + "\n")
        log.close()
    return res


if __name__ == "__main__":
    main()
