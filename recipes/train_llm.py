"""Train a llama-family model in pipeline mode from a JSON file (pretrain / instruct / conversation).

    python -m recipes.llm_data --make-example data/example_llm.json
    torchrun --standalone --nproc_per_node 2 -m recipes.train_llm --data data/example_llm.json --pp 2 \\
        --steps 20 --dtype bf16 --save ckpt --export-hf hf_out --prompt "What is 2 plus 3?"
    torchrun --standalone --nproc_per_node 4 -m recipes.train_llm --data data/example_llm.json --pp 2 \\
        --zero-stage 1 --offload --optimizer lion --parts 3 4 --checkpoint-interval 1

The model: transformers' LlamaForCausalLM from a size preset (pipeline_parallel/models/llama.py,
random init, offline) or from HF weights (--hf-init DIR: converted by pipeline_parallel/convert.py
and loaded into the stages). Data: recipes/llm_data.py (loss only on answers), each
data replica reading its share through initialize(training_data=...). Every option maps to a
DeepSpeed config key or PipelineModule argument, printed on rank 0 at start. At the end: a pipeline
checkpoint (--save, DeepSpeed's layout), the HF export (--export-hf) and, with --prompt, rank 0
generates from the exported model with model.generate. Cost per step: the pipeline's (m
micro-batches × forward + backward per stage, 2·m·b·seq·h·bytes per boundary).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
from transformers import LlamaForCausalLM

from pipeline_parallel.convert import hf_to_pp, pp_to_hf
from pipeline_parallel.engine.ds_pipe import PipelineModule, initialize
from recipes.llm_data import ByteTokenizer, load_dataset
from pipeline_parallel.models import llama_config, llama_layers, llama_loss, llama_model
from primitives.launch import init_from_env
from primitives.log import print0


def ds_config(a) -> dict:
    opt = ({"type": "Lion", "params": {"lr": a.lr, "weight_decay": 0.0}} if a.optimizer == "lion" else
           {"type": "AdamW", "params": {"lr": a.lr, "weight_decay": 0.0, "torch_adam": True}})
    z = {"stage": a.zero_stage, **({"offload_optimizer": {"device": "cpu"}} if a.offload else {})}
    cfg = {"train_micro_batch_size_per_gpu": a.micro_batch_size, "gradient_accumulation_steps": a.micro_batches,
           "optimizer": opt, "gradient_clipping": 1.0, "zero_optimization": z, "steps_per_print": a.log_every,
           "bf16": {"enabled": a.dtype == "bf16"}, "fp16": {"enabled": a.dtype == "fp16", "initial_scale_power": 12}}
    return cfg


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--format", choices=["pretrain", "instruct", "conversation"], default=None, help="default: detected")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--hf-init", default=None, help="start from this HF LlamaForCausalLM directory")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--parts", type=int, nargs="+", default=None, help="layers per stage (gdGPT's parts)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    ap.add_argument("--optimizer", choices=["adamw", "lion"], default="adamw")
    ap.add_argument("--zero-stage", type=int, choices=[0, 1], default=0)
    ap.add_argument("--offload", action="store_true", help="offload_optimizer cpu (with --zero-stage 1)")
    ap.add_argument("--checkpoint-interval", type=int, default=0, help="activation checkpointing every k layers")
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--save", default=None, help="pipeline checkpoint directory")
    ap.add_argument("--export-hf", default=None, help="write the trained model as an HF directory (the pipeline "
                                                      "checkpoint goes to --save, or DIR_pipeline)")
    ap.add_argument("--prompt", default=None, help="rank 0 generates from the exported model")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    a = ap.parse_args(argv)
    if not dist.is_initialized():
        init_from_env()
    if a.hf_init:
        with open(os.path.join(a.hf_init, "config.json")) as f:
            hf_cfg = json.load(f)
        model = LlamaForCausalLM(llama_config(a.preset, **{k: hf_cfg[k] for k in ("hidden_size", "num_hidden_layers",
                                 "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
                                 "tie_word_embeddings") if k in hf_cfg}))
    else:
        model = llama_model(a.preset)
    net = PipelineModule(llama_layers(model.train()), num_stages=a.pp, loss_fn=llama_loss,
                         partition_method=a.parts or "parameters", activation_checkpoint_interval=a.checkpoint_interval)
    data = load_dataset(a.data, a.seq, a.format)
    cfg = ds_config(a)
    engine, _, loader, _ = initialize(model=net, config=cfg, training_data=data)
    print0(f"llama {a.preset}: {sum(p.numel() for p in model.parameters()):,} parameters, layers per stage "
           f"{[net.parts[s + 1] - net.parts[s] for s in range(a.pp)]}, pp={engine.pp} × dp={engine.dp}, "
           f"{len(data)} samples of {a.seq} tokens, config {json.dumps(cfg)}")
    if a.hf_init:
        with tempfile.TemporaryDirectory() as tmp:           # each rank converts, then loads its own layers
            hf_to_pp(a.hf_init, tmp)
            engine.load_checkpoint(tmp, load_module_only=True)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = engine.train_batch()
    print0(f"final loss {float(loss):.4f}, {(time.perf_counter() - t0) / a.steps:.2f} s/step, "
           f"skipped steps {engine.skipped_steps}")
    if a.save or a.export_hf:
        save = a.save or a.export_hf.rstrip("/") + "_pipeline"     # one path every rank agrees on
        engine.save_checkpoint(save)
        if dist.get_rank() == 0:
            model.config.save_pretrained(save)
            if a.export_hf:
                pp_to_hf(save, a.export_hf)
                print0(f"exported {a.export_hf}")
                if a.prompt:
                    hf = LlamaForCausalLM.from_pretrained(a.export_hf).float().eval()
                    tok = ByteTokenizer()
                    ids = torch.tensor([tok.encode(f"### Instruction:\n{a.prompt}\n### Response:\n")])
                    out = hf.generate(ids, max_new_tokens=24, do_sample=False)
                    print0(f"generate: {tok.decode(out[0, ids.shape[1]:])!r}")
        dist.barrier()


if __name__ == "__main__":
    main()
