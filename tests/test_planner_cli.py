"""The planner's command line: models from a Hugging Face config, the JSON and the picture, --fix and
--all, the 70 B / 512 H100 run's time (printed), cpu-here's hardware file."""
import json
import sys

import pytest

from conftest import run_cmd
from planner import hardware as H, hosts as HO
from planner.__main__ import main as planner_main
from planner.model import PRESETS, Model, from_config_dict, from_hf_config, resolve
from planner.plan import plan


def test_hf_config(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
           "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096,
           "tie_word_embeddings": False, "hidden_act": "silu", "rope_theta": 10000.0}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    assert from_hf_config(str(p)).params() == PRESETS["llama-7b"].params()
    assert resolve(str(tmp_path)).layers == 32
    with pytest.raises(ValueError):
        resolve("custom", layers=2)


def test_cli_json_and_plot(tmp_path):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    r = run_cmd(f"python -m planner llama-7b --gpus 16 --hardware a100 --global-batch 64 --top 3 --json {out} --plot {png}")
    assert "llama-7b" in r.stdout and "step s" in r.stdout
    doc = json.loads(out.read_text())
    lay = doc["layouts"][0]
    assert set(lay["time_s"]) >= {"matmul", "tp comm", "dp comm", "bubble", "total"}
    assert sum(v for k, v in lay["memory_bytes"].items() if k != "total" and not isinstance(v, str)) == \
        pytest.approx(lay["memory_bytes"]["total"])
    assert png.exists() and png.stat().st_size > 10_000


def test_cli_custom_fix_and_all(tmp_path):
    out = tmp_path / "all.json"
    run_cmd(f"python -m planner custom --layers 4 --hidden 256 --heads 4 --vocab 1000 --seq 64 --gpus 4 "
            f"--hardware a100 --global-batch 8 --fix tp=2,recompute=full --all --json {out}")
    doc = json.loads(out.read_text())
    assert doc["params"] == Model("c", 4, 256, 4, 1000, 64).params()
    assert doc["layouts"] and all(x["layout"]["tp"] == 2 and x["layout"]["recompute"] == "full" for x in doc["layouts"])
    tight = tmp_path / "tight.json"
    r = run_cmd(f"python -m planner llama-70b --gpus 8 --hardware a100 --global-batch 8 --fix offload=false --all "
                f"--json {tight}", check=False)
    assert r.returncode == 1 and "no layout" in r.stdout          # 70 B × 16 bytes > 8 × 80 GB without offload
    assert not any(x["fits"] for x in json.loads(tight.read_text())["layouts"])


def test_cpu_here_loads():
    hw = H.load("cpu-here")
    assert hw.bytes_per_elem == 4 and hw.peak_flops > 1e9
    assert plan(PRESETS["tiny"], 2, hw, 32, 8)


def test_cpu_here_says_when_fitted_on_another_processor(tmp_path, monkeypatch, capsys):
    """cpu_here.json's rates are CPU seconds of the processor it was fitted on: loading it on
    another one says so (both named) and how to refit; on the same one it says nothing."""
    with open(H.CPU_HERE) as f:
        doc = json.load(f)
    doc.pop("cpu", None)
    for cpu, said in (("Elsewhere CPU (family 6, model 1, stepping 0, 2 cores)", True), (None, True), (HO.this_cpu(), False)):
        p = tmp_path / f"{cpu is None}{said}.json"
        p.write_text(json.dumps({**doc, **({"cpu": cpu} if cpu else {})}))
        monkeypatch.setattr(H, "CPU_HERE", str(p))
        monkeypatch.setattr(HO, "_WARNED", set())
        hw = H.load("cpu-here")
        err = capsys.readouterr().err
        assert hw.peak_flops == doc["peak_flops"]
        assert (HO.this_cpu() in err and (cpu or "does not say which processor") in err
                and "benchmarks.planner_fit" in err) is said, err
        assert bool(err) is said, err
        H.load("cpu-here")
        assert not capsys.readouterr().err, "said once per file, not on every load"


def test_partial_refit_refuses_another_processors_file(tmp_path, capsys):
    """`planner_fit --loss/--waits/--engine/--links/--llama` update one term of a whole fit: into a file fitted on
    another processor (or on one it does not name) they refuse before measuring, naming both."""
    from benchmarks.planner_fit import main
    with open(H.CPU_HERE) as f:
        doc = json.load(f)
    p = tmp_path / "other.json"
    p.write_text(json.dumps({**doc, "cpu": "Elsewhere CPU"}))
    for flag in ("--loss", "--waits", "--engine", "--links", "--llama"):
        with pytest.raises(SystemExit) as e:
            main([flag, "--out", str(p)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "Elsewhere CPU" in err and HO.this_cpu() in err and "whole fit" in err, err
    assert json.loads(p.read_text()) == {**doc, "cpu": "Elsewhere CPU"}, "the file is untouched"


@pytest.mark.parametrize("args, said", [
    ("nosuchmodel --gpus 8", "unknown model 'nosuchmodel'"),
    ("llama-70b --gpus 0", "argument --gpus: expected a positive integer, got '0'"),
    ("llama-70b --gpus 8 --seq -1", "argument --seq: expected a positive integer"),
    ("llama-70b --gpus 8 --fix foo=1", "'foo' is not a layout field"),
    ("llama-70b --gpus 8 --fix tp", "expected FIELD=VALUE"),
    ("llama-70b --gpus 8 --fix zero=5", "zero=5: expected 0, 1, 2 or 3"),
    ("llama-70b --gpus 8 --fix recompute=some", "expected none | selective | full"),
    ("llama-70b --gpus 8 --fix sp=yes", "sp='yes': expected true | false"),
    ("llama-70b --gpus 8 --fix tp=2,tp=4", "tp is given twice"),
    ("llama-70b --gpus 8 --json /nonexistent-folder/x.json", "--json /nonexistent-folder/x.json: expected a file in a writable folder"),
    ("llama-70b --gpus 8 --json /tmp", "--json /tmp: expected a file"),
    ("llama-70b --gpus 8 --plot /tmp/plan.txt", "matplotlib cannot write .txt"),
    ("llama-70b --gpus 8 --fix tp=--2", "--fix 'tp=--2': fixed tp='--2': expected a positive integer"),
    ("custom --layers 2 --hidden 64 --heads 3 --vocab 10 --gpus 2", "hidden 64 is not a multiple of heads 3"),
])
def test_cli_refuses_bad_input_naming_it(args, said, capsys):
    """Nothing silent: an argument the planner cannot honour stops it at once (exit 2), the message
    naming the argument and what was expected; no table is printed. (In process: the command line's
    main, as `python -m planner` runs it.)"""
    if "--plot" in args:
        pytest.importorskip("matplotlib")     # the figures extra: without it --plot is refused for that
    try:
        rc = planner_main(args.split())
    except SystemExit as e:     # argparse's refusals
        rc = e.code
    got = capsys.readouterr()
    out = " ".join((got.out + got.err).split())
    assert rc == 2 and said in out and "layouts predicted" not in out, out


def test_cli_says_why_no_layout_is_legal_and_writes_whole_files(tmp_path, capsys):
    """A pinned field no layout can take is named with the reason; a folder without config.json
    or a file that is not one is an error naming the file; --fix dp pins dp; the JSON is written
    whole (a temporary file renamed onto it: nothing else left in the folder). In process."""
    def run(args):
        rc = planner_main([str(a) for a in args])
        return rc, " ".join(capsys.readouterr().out.split())
    rc, out = run(["llama-70b", "--gpus", 8, "--fix", "tp=3"])
    assert rc == 1 and "tp·pp = 3 does not divide 8 GPUs" in out
    (tmp_path / "list.json").write_text("[1]")
    for target, said in ((tmp_path, "cannot read a Hugging Face config.json"), (tmp_path / "list.json", "holds a JSON object")):
        rc, out = run([target, "--gpus", 8])
        assert rc == 2 and said in out
    out = tmp_path / "dp2.json"
    assert run(["llama-7b", "--gpus", 8, "--hardware", "a100", "--fix", "dp=2", "--all", "--json", out])[0] == 0
    doc = json.loads(out.read_text())
    assert doc["layouts"] and {x["layout"]["dp"] for x in doc["layouts"]} == {2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dp2.json", "list.json"]


def test_hub_name_is_read_by_autoconfig_and_an_unreadable_one_says_so(monkeypatch):
    """MODEL as org/name: transformers' AutoConfig reads its config (the hub or its cache) and the
    planner counts what a config.json of it would give; one it cannot read is an error naming the
    model and what to pass instead (here the hub is out of reach: offline)."""
    import transformers
    cfg = transformers.LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                                   intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096)
    seen = []
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda name, *a, **k: seen.append(name) or cfg)
    m = resolve("someone/llama-7b-copy")
    assert seen == ["someone/llama-7b-copy"] and m.name == "llama-7b-copy" and m.source == "hub:someone/llama-7b-copy"
    assert m.params() == PRESETS["llama-7b"].params()

    def offline(name, *a, **k):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    with pytest.raises(ValueError, match="'nobody/nothing' is not a preset or a file here.*OSError.*pass its config.json"):
        resolve("nobody/nothing")


def test_config_fields_read_as_transformers_writes_them(tmp_path):
    """A rotary model that is not gated (GPT-NeoX: transformers 5 writes rope_parameters and
    rotary_pct) has no position table; a config whose sizes are not integers is an error naming
    the field; a local .json path that does not exist is never sent to the hub."""
    import transformers
    neox = from_config_dict(transformers.GPTNeoXConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                                       intermediate_size=256, vocab_size=1000).to_dict(), "neox", "test")
    assert neox.positions == 0 and not neox.gated
    gpt2 = from_config_dict(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000).to_dict(), "gpt2", "test")
    assert gpt2.positions == 1024 and gpt2.ffn == 0
    with pytest.raises(ValueError, match="layers must be an integer, found '32'"):
        from_config_dict({"num_hidden_layers": "32", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10}, "x", "t")
    with pytest.raises(ValueError, match="unknown model 'configs/x.json'"):
        resolve("configs/x.json")


def test_plot_without_matplotlib_names_the_extra(monkeypatch, capsys, tmp_path):
    """matplotlib is an optional extra: without it --plot is refused at start, naming the extra."""
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)     # import raises ImportError
    with pytest.raises(SystemExit) as e:
        planner_main(["tiny", "--gpus", "2", "--plot", str(tmp_path / "p.png")])
    assert e.value.code == 2 and "--plot needs matplotlib" in capsys.readouterr().err


def test_a_hardware_file_with_a_layer_line_it_would_not_read_is_refused(tmp_path, capsys):
    """A fitted layer line (op_overhead, llama's two terms) is read only with elementwise_s: a file
    that sets one without it is refused, naming the file and the fields, not run without them."""
    from dataclasses import asdict
    p = tmp_path / "gpu.json"
    p.write_text(json.dumps({**asdict(H.A100), "llama_op_overhead": 1e-3}))
    with pytest.raises(ValueError, match="llama_op_overhead set without elementwise_s"):
        H.load(str(p))
    try:
        rc = planner_main(["tiny", "--gpus", "2", "--hardware", str(p)])
    except SystemExit as e:
        rc = e.code
    got = capsys.readouterr()
    said = " ".join((got.out + got.err).split())
    assert rc == 2 and "gpu.json" in said and "llama_op_overhead set without elementwise_s" in said, said
    p.write_text(json.dumps(asdict(H.A100)))
    assert H.load(str(p)) == H.A100                     # the same file without it loads
