"""Llama weights both ways: a Hugging Face directory ↔ DeepSpeed's pipeline layer files.

    python -m pipeline_parallel.convert hf_to_pp --input-path hf_dir --save-path pp_dir
    python -m pipeline_parallel.convert pp_to_hf --input-path ckpt_dir --save-path hf_out [--config-path hf_dir]

hf_to_pp writes pp_dir/global_step0/layer_XX-model_states.pt (the layer numbering of
pipeline_parallel/models/llama.py: 0 embedding, 1 … n decoder blocks, n+1 final norm, n+2 LM head —
absent when the embeddings are tied, as a pipeline save leaves it), pp_dir/latest and HF's
config.json; engine.load_checkpoint(pp_dir, load_module_only=True) then starts training from it,
whatever the number of stages (layer files do not depend on the partition). pp_to_hf reads the
tag in `latest` (or a directory of layer files) and writes model.safetensors + config.json, which
LlamaForCausalLM.from_pretrained reads. Tensors are copied as they are (no dtype change): the
round trip is bit for bit. Cost: one read and one write of every weight; memory: the whole model
once (stream layer by layer for models beyond host memory).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

from pipeline_parallel.engine.checkpoint import layer_path
from primitives.log import console
from zero_from_scratch.engine.atomic import atomic_write
from zero_from_scratch.engine.checkpoint_read import tag_folder

HF_EXTRA = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
            "special_tokens_map.json")


def _hf_state(hf_dir: str) -> dict:
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if files:
        sd = {}
        for f in files:
            sd.update(load_file(f))
        return sd
    bins = sorted(glob.glob(os.path.join(hf_dir, "pytorch_model*.bin")))
    if not bins:
        raise FileNotFoundError(f"{hf_dir}: no *.safetensors or pytorch_model*.bin weights")
    sd = {}
    for f in bins:
        sd.update(torch.load(f, map_location="cpu", weights_only=True))
    return sd


def hf_to_layers(sd: dict, config: dict) -> dict[int, dict]:
    """HF names → {pipeline layer index: that layer's state_dict}."""
    n = config["num_hidden_layers"]
    layers: dict[int, dict] = {}
    for name, t in sd.items():
        if name == "model.embed_tokens.weight":
            layers.setdefault(0, {})["embed_tokens.weight"] = t
        elif name.startswith("model.layers."):
            i, rest = re.match(r"model\.layers\.(\d+)\.(.*)", name).groups()
            layers.setdefault(int(i) + 1, {})["layer." + rest] = t
        elif name.startswith("model.norm."):
            layers.setdefault(n + 1, {})[name[len("model."):]] = t
        elif name == "lm_head.weight":
            if not config.get("tie_word_embeddings", False):
                layers.setdefault(n + 2, {})["lm_head.weight"] = t
        elif name.endswith("rotary_emb.inv_freq"):
            continue                      # recomputed from the config, never trained
        else:
            raise ValueError(f"HF weight {name!r} has no place in the llama pipeline layers")
    return layers


def layers_to_hf(layers: dict[int, dict], config: dict) -> dict:
    n, sd = config["num_hidden_layers"], {}
    for i, layer in sorted(layers.items()):
        for k, t in layer.items():
            if i == 0:
                sd["model." + k] = t
            elif i <= n:
                sd[f"model.layers.{i - 1}." + k[len("layer."):]] = t
            elif i == n + 1:
                sd["model." + k] = t
            else:
                sd[k] = t
    return sd


def _copy_hf_files(src: str, dst: str) -> None:
    for name in ("config.json",) + HF_EXTRA:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))


def hf_to_pp(hf_dir: str, out_dir: str, tag: str = "global_step0") -> str:
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    d = os.path.join(out_dir, tag)
    os.makedirs(d, exist_ok=True)
    for i, layer in sorted(hf_to_layers(_hf_state(hf_dir), config).items()):
        torch.save(layer, layer_path(d, i))
    atomic_write(os.path.join(out_dir, "latest"), lambda f: f.write(tag.encode()))
    _copy_hf_files(hf_dir, out_dir)
    return d


def pp_to_hf(pp_dir: str, out_dir: str, config_path: str | None = None) -> str:
    config_path = config_path or os.path.join(pp_dir, "config.json")
    if os.path.isdir(config_path):
        config_path = os.path.join(config_path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path}: pp_to_hf needs the model's HF config.json (--config-path)")
    with open(config_path) as f:
        config = json.load(f)
    if not glob.glob(layer_path(pp_dir, "*")) and not os.path.isfile(os.path.join(pp_dir, "latest")):
        raise FileNotFoundError(f"{pp_dir}: neither layer_XX-model_states.pt files nor a 'latest' tag file")
    d = pp_dir if glob.glob(layer_path(pp_dir, "*")) else tag_folder(pp_dir)   # layer files, or the tag `latest` names
    layers = {}
    for path in glob.glob(layer_path(d, "*")):
        i = int(re.search(r"layer_(\d+)", os.path.basename(path)).group(1))
        layers[i] = torch.load(path, map_location="cpu", weights_only=True)
    n = config["num_hidden_layers"]
    want = set(range(n + 2)) | (set() if config.get("tie_word_embeddings", False) else {n + 2})
    if set(layers) != want:
        raise ValueError(f"{d}: layer files {sorted(layers)} do not match the config's {n} decoder layers "
                         f"(expected {sorted(want)})")
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in layers_to_hf(layers, config).items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    _copy_hf_files(os.path.dirname(config_path), out_dir)
    return out_dir


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("direction", choices=["hf_to_pp", "pp_to_hf"])
    ap.add_argument("--input-path", required=True)
    ap.add_argument("--save-path", required=True)
    ap.add_argument("--config-path", default=None, help="pp_to_hf: HF config.json or its directory "
                                                         "(default: the input path's config.json)")
    a = ap.parse_args(argv)
    out = hf_to_pp(a.input_path, a.save_path) if a.direction == "hf_to_pp" else \
        pp_to_hf(a.input_path, a.save_path, a.config_path)
    console.print(f"{a.direction}: {a.input_path} → {out}")


if __name__ == "__main__":
    main()
