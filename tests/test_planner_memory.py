"""planner.memory's terms for this machine's CPU ranks beyond the live tensors: the runtime's pages
per layer family (probed once) and glibc's slack moved from its calibrations; the parts
benchmarks.planner_mem splits a measured peak into. No rank runs here (the measurements are
`python -m benchmarks.planner_mem` and `python -m benchmarks.planner_mem_probe`)."""
import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest

from benchmarks.planner_fit_engine import CAL
from benchmarks.planner_mem import parts
from benchmarks.planner_ranks import llama_planner_model
from benchmarks.planner_ranks_tp import distilbert_planner_model
from planner import hardware as H
from planner import host_memory as HM
from planner import memory as PM
from planner.layout import Layout
from planner.model import PRESETS, Model
from planner.steptime import Software

MiB = 2**20
GPT = Model("gpt-mini", 4, 256, 4, 8192, 128, positions=128)


@pytest.fixture
def probed(tmp_path, monkeypatch):
    """planner.memory reading a cpu_mem.json of known values."""
    path = tmp_path / "cpu_mem.json"
    path.write_text(json.dumps({"runtime": {"torch": {"file": 1.0 * MiB, "anon": 2.0 * MiB},
                                            "distilbert": {"file": 8.0 * MiB, "anon": 2.0 * MiB},
                                            "llama": {"file": 3.0 * MiB, "anon": 2.0 * MiB},
                                            "zero": {"file": 0.5 * MiB, "anon": 1.5 * MiB}}}))
    monkeypatch.setattr(HM, "CPU_MEM", str(path))
    HM._cpu_mem.cache_clear()
    yield path
    HM._cpu_mem.cache_clear()


def test_runtime_term_is_the_probed_family(probed):
    distil = distilbert_planner_model("d", 4, 256, 4, 8192, 128)
    assert [HM.runtime_bytes(m) / MiB for m in (GPT, distil, llama_planner_model("tiny", 128))] == [3.0, 10.0, 5.0]
    mem = PM.memory(GPT, 128, Layout(2, 1, 1, mb=4), 8, H.cpu_here(2))
    assert mem["runtime"] == 3.0 * MiB and mem["total"] == pytest.approx(sum(v for k, v in mem.items() if k not in ("total", "stage")))
    # the ZeRO engine's own runtime on top of the family's, at every stage ≥ 1 (with a pipeline too)
    for z in (1, 2, 3):
        assert PM.memory(GPT, 128, Layout(2, 1, 1, zero=z, mb=4), 8, H.cpu_here(2))["runtime"] == 5.0 * MiB
    assert HM.runtime_bytes(GPT, Layout(2, 1, 2, zero=1, mb=2)) == 5.0 * MiB and HM.runtime_bytes(GPT, Layout(2, 1, 1, mb=4)) == 3.0 * MiB


def test_runtime_term_is_zero_unprobed(tmp_path, monkeypatch):
    monkeypatch.setattr(HM, "CPU_MEM", str(tmp_path / "absent.json"))
    HM._cpu_mem.cache_clear()
    try:
        assert HM.runtime_bytes(GPT) == 0.0
    finally:
        HM._cpu_mem.cache_clear()


def test_slack_calibration_shape_is_planner_fits():
    from benchmarks.planner_slack_seeds import MB
    assert HM.SLACK_CAL == CAL and HM.SLACK_CAL_MB == MB       # the micro-batch slack_fit launches it at


def test_slack_moves_with_the_largest_freed_block_from_the_calibrations(probed):
    """One micro-batch a step (DDP, tp; ZeRO-1/2 without their own fit): the calibrated slack plus
    SLACK_SLOPE·(S − S_cal), S the largest block the step frees below glibc's 32 MiB mmap ceiling; never below 0."""
    hw = replace(H.cpu_here(2), alloc_slack=50.0 * MiB, pipe_slack=0.0, zero1_slack=0.0, zero2_slack=0.0)
    assert HM.allocator_slack(CAL, Layout(2, 1, 1, mb=4), 128, HM.CAL_BLOCKS, hw) == pytest.approx(50.0 * MiB)  # the calibration step
    assert HM.largest_freed(CAL, Layout(2, 1, 1, mb=4), 128, HM.CAL_BLOCKS) == 4 * 4 * 128 * CAL.vocab      # its logits, 24 MiB
    ddp = PM.memory(GPT, 128, Layout(2, 1, 1, mb=4), 8, hw)        # gpt-mini's logits: 16 MiB
    assert ddp["allocator"] == pytest.approx(50.0 * MiB + 2 * (16 - 24) * MiB)
    assert PM.memory(GPT, 128, Layout(2, 1, 1, zero=1, mb=4), 8, hw)["allocator"] == ddp["allocator"]
    tp = PM.memory(GPT, 128, Layout(1, 2, 1, mb=4), 4, hw)         # the vocabulary split: 8 MiB of logits per rank
    assert tp["allocator"] == pytest.approx(50.0 * MiB + 2 * (8 - 24) * MiB)
    wide = replace(GPT, hidden=384, heads=6, vocab=16384)          # logits 32 MiB, always mapped: its ends (24 MiB) count
    assert PM.memory(wide, 128, Layout(2, 1, 1, mb=4), 8, hw)["allocator"] == pytest.approx(50.0 * MiB)
    assert PM.memory(GPT, 128, Layout(2, 1, 1, mb=4), 8, replace(hw, alloc_slack=5.0 * MiB))["allocator"] == 0.0


def test_the_zero_engines_step_keeps_its_fitted_bytes_per_byte_of_its_largest_freed_block(probed):
    """zero_from_scratch's ZeRO-1 and ZeRO-2 steps with their fits: zero1_slack / zero2_slack × S (gpt-mini's
    logits, 16 MiB), whatever alloc_slack; DDP and ZeRO-3 (mapped: none) keep theirs; a pipeline's stage its own."""
    hw = replace(H.cpu_here(2), alloc_slack=50.0 * MiB, pipe_slack=5.0, zero1_slack=4.0, zero2_slack=3.0, slack_sigma=0.0)
    z1, z2, z3, ddp = (PM.memory(GPT, 128, Layout(2, 1, 1, zero=z, mb=4), 8, hw)["allocator"] for z in (1, 2, 3, 0))
    assert (z1, z2, z3) == (pytest.approx(4.0 * 16 * MiB), pytest.approx(3.0 * 16 * MiB), 0.0)
    assert ddp == pytest.approx(50.0 * MiB + 2 * (16 - 24) * MiB)
    piped = PM.memory(GPT, 128, Layout(2, 1, 2, zero=1, mb=2), 16, hw)
    assert piped["allocator"] == pytest.approx(5.0 * 8 * MiB)      # the pipeline's rule: its last stage's 8 MiB blocks
    assert PM.memory(GPT, 128, Layout(2, 1, 1, zero=1, mb=4), 8, replace(hw, zero1_slack=0.0))["allocator"] == ddp
    # a pipeline without its own fit takes the one-micro-batch rule, not the ZeRO engine's (fitted on one stage)
    unfit = PM.memory(GPT, 128, Layout(2, 1, 2, zero=1, mb=2), 16, replace(hw, pipe_slack=0.0))
    assert unfit["allocator"] == pytest.approx(50.0 * MiB + 2 * (8 - 24) * MiB)


def test_the_fullest_of_k_ranks_is_the_median_of_the_largest_of_k_draws():
    """worst_of against a simulation: ln(slack) normal with σ, the median over many trials of the
    largest of k draws over the median of the largest of k_fit; 1 at k = k_fit or σ = 0, growing with k."""
    import numpy as np
    sigma = 0.2
    draws = np.exp(np.random.default_rng(0).normal(0.0, sigma, size=(40_000, 8)))
    med = lambda k: np.median(draws[:, :k].max(axis=1))     # noqa: E731
    for k, k_fit in ((2, 1), (4, 1), (4, 2), (8, 2), (1, 2)):
        assert HM.worst_of(k, k_fit, sigma) == pytest.approx(med(k) / med(k_fit), rel=0.01), (k, k_fit)
    assert HM.worst_of(2, 2, sigma) == HM.worst_of(4, 1, 0.0) == 1.0
    assert 1.0 < HM.worst_of(2, 1, sigma) < HM.worst_of(4, 1, sigma) < HM.worst_of(8, 1, sigma)
    # the spread pooled over the fits' sets, each about its own level
    assert HM.slack_sigma([[1.0, np.e ** 0.2, np.e ** -0.2], [5.0, 5 * np.e ** 0.2, 5 * np.e ** -0.2], [7.0]]) == pytest.approx(0.2)


def test_a_stage_held_by_more_ranks_than_its_fit_keeps_its_fullest_ranks_slack(probed):
    """allocator_slack moves each rule by worst_of(dp·tp, the ranks its fit took the larger of): a
    pipeline stage (fitted on one rank) held by two ranks, a DDP step on four; DDP on two as fitted."""
    hw = replace(H.cpu_here(2), alloc_slack=50.0 * MiB, pipe_slack=5.0, zero1_slack=4.0, zero2_slack=0.0, slack_sigma=0.2)
    flat = replace(hw, slack_sigma=0.0)
    last = {"activations": 1.0, "logit_grads": 1.0, "ends": 1.0}
    for lay, k_fit in ((Layout(2, 1, 2, mb=2), HM.FIT_RANKS["pipe"]), (Layout(4, 1, 1, mb=4), HM.FIT_RANKS["ddp"]),
                       (Layout(2, 2, 1, zero=1, mb=4), HM.FIT_RANKS["zero"]), (Layout(2, 1, 1, mb=4), HM.FIT_RANKS["ddp"])):
        got, rule = (HM.allocator_slack(GPT, lay, 128, last, h) for h in (hw, flat))
        assert got == pytest.approx(rule * HM.worst_of(lay.dp * lay.tp, k_fit, 0.2)), lay
    assert HM.allocator_slack(GPT, Layout(2, 1, 1, mb=4), 128, last, hw) == HM.allocator_slack(GPT, Layout(2, 1, 1, mb=4), 128, last, flat)
    assert HM.allocator_slack(GPT, Layout(2, 1, 2, mb=2), 128, last, hw) > HM.allocator_slack(GPT, Layout(1, 1, 2, mb=2), 128, last, hw)


def test_the_zero_engines_slack_fit_is_the_median_launch_per_byte_of_its_largest_block(monkeypatch):
    """benchmarks.planner_fit_engine.slack_fit at stage 1: the calibration shape's ZeRO-1 engine step in
    fresh interpreters (launch mode zero1); the median slack over its largest freed block (its logits, 24 MiB)."""
    from benchmarks import planner_fit_engine as FE
    hw = H.cpu_here(2)
    lay = Layout(2, 1, 1, zero=1, mb=4)
    pred = PM.memory(CAL, CAL.seq, lay, 8, replace(hw, alloc_slack=0.0, zero1_slack=0.0, zero2_slack=0.0))
    count = pred["total"] - pred["reserved"] - pred["allocator"]
    big = 4 * 4 * 128 * CAL.vocab
    peaks, calls = iter([count + 3 * big, count + 5 * big, count + 4 * big]), []
    monkeypatch.setattr(FE, "launch", lambda shape, steps, mode, seed: calls.append((shape, steps, mode, seed)) or next(peaks))
    monkeypatch.setattr(FE, "cpu_here", lambda n, fitted: replace(hw, **{k: fitted[k] for k in ("alloc_slack", "zero1_slack",
                                                                                               "zero2_slack")}))
    got, each = FE.slack_fit({"alloc_slack": 0.0, "zero1_slack": 0.0, "zero2_slack": 0.0}, launches=3, zero=1)
    assert calls == [(CAL.name, 4, "zero1", None)] * 3
    assert got == pytest.approx(4.0) and each == pytest.approx([3 * big, 5 * big, 4 * big])


def test_a_pipeline_stage_keeps_its_fitted_bytes_per_byte_of_its_largest_freed_block(probed):
    """pp > 1 with pipe_slack fitted: pipe_slack × S of the heavier stage (the last: its logits) ×
    √(micro-batches / 4); the first stage's S is its widest block; without the fit, the one-micro-batch rule."""
    hw = replace(H.cpu_here(2), alloc_slack=50.0 * MiB, pipe_slack=5.0, slack_sigma=0.0)
    lay = Layout(1, 1, 2, mb=2)
    last = {"activations": 1.0, "logit_grads": 1.0, "ends": 1.0}
    assert HM.allocator_slack(GPT, lay, 128, last, hw) == pytest.approx(5.0 * 8 * MiB)    # logits and ends: 8 MiB each
    small_v = replace(GPT, vocab=2048)        # logits 2 MiB, ends 2 MiB: the FFN's b·s·4h, 1 MiB, is below them
    assert HM.allocator_slack(small_v, lay, 128, last, hw) == pytest.approx(5.0 * 2 * MiB)
    first = {"activations": 1.0, "logit_grads": 0.0, "ends": 1.0}
    assert HM.largest_freed(replace(GPT, vocab=512), lay, 128, first) == 4 * 2 * 128 * 1024      # the FFN's b·s·4h, 1 MiB
    assert HM.largest_freed(GPT, lay, 128, first) == 4 * GPT.vocab * GPT.hidden                  # the embedding, 8 MiB
    assert HM.allocator_slack(GPT, lay, 128, last, replace(hw, pipe_slack=0.0)) == pytest.approx(50.0 * MiB + 2 * (8 - 24) * MiB)
    # the square root of the micro-batches over the fit's four: 16 keep twice what 4 do
    assert HM.allocator_slack(GPT, lay, 128, last, hw, micro=16) == pytest.approx(2 * 5.0 * 8 * MiB)
    assert PM.memory(GPT, 128, lay, 32, hw)["allocator"] == pytest.approx(2 * PM.memory(GPT, 128, lay, 8, hw)["allocator"])
    # llama tiny without probed factors: the torch pipeline rule on its largest block
    tiny = llama_planner_model("tiny", 128)
    mem = PM.memory(tiny, 128, lay, 8, hw)
    kinds = {"activations": 1.0, "logit_grads": 1.0 if mem["stage"] == "last" else 0.0, "ends": 1.0}
    assert mem["allocator"] == pytest.approx(5.0 * HM.largest_freed(tiny, lay, 128, kinds)) and mem["allocator"] > 0


def test_llama_slack_is_its_factors_times_the_stages_freed_blocks(probed):
    """With probed factors the llama family's slack is a sum over the stage's blocks — its
    activations, the loss's logit gradients, its end matrices — each times its factor, whatever
    the calibrated slack; other families keep the torch layer's rule."""
    data = json.loads(probed.read_text())
    factors = {"activations": 0.5, "logit_grads": 2.0, "ends": 3.0}
    probed.write_text(json.dumps({**data, "slack": {"llama": factors}}))
    HM._cpu_mem.cache_clear()
    hw = replace(H.cpu_here(2), alloc_slack=55.0 * MiB)
    small = llama_planner_model("small", 128)
    two, eight = (PM.memory(small, 128, Layout(1, 1, 2, mb=mb), 4 * mb, hw) for mb in (2, 8))
    for mem in (two, eight):      # the first stage: two micro-batches' activations, the embedding, no logits
        assert mem["stage"] == "first"
        assert mem["allocator"] == pytest.approx(0.5 * mem["activations"] + 3.0 * 4 * small.vocab * small.hidden)
    assert eight["allocator"] > 3 * two["allocator"]             # a larger micro-batch keeps more, as measured
    assert PM.memory(small, 128, Layout(1, 1, 2, mb=2), 8, replace(hw, alloc_slack=0.0))["allocator"] == two["allocator"]
    # one stage holding everything: its top adds its logit gradients (two b·s·V fp32 blocks) and the head
    whole = PM.memory(small, 128, Layout(1, 1, 1, mb=2), 2, hw)
    ends = 4 * (small.vocab * small.hidden * 2 + small.hidden)       # embedding, untied head, final norm
    assert whole["allocator"] == pytest.approx(0.5 * whole["activations"] + 2.0 * 2 * 4 * 2 * 128 * small.vocab + 3.0 * ends)
    assert HM.allocator_slack(CAL, Layout(2, 1, 1, mb=4), 128, HM.CAL_BLOCKS, hw) == pytest.approx(55.0 * MiB)
    assert PM.memory(small, 128, Layout(1, 1, 2, mb=2), 8, hw, Software(mapped_alloc=True))["allocator"] == 0.0


def test_llama_blocks_glibc_always_maps_keep_no_slack(probed):
    """A block of 32 MiB or more is mapped at glibc's defaults whatever its history, so a kind whose one
    block reaches that adds nothing: a 7 B llama's stages keep none, and a large vocabulary's end
    matrices drop out while the small activations still count."""
    data = json.loads(probed.read_text())
    probed.write_text(json.dumps({**data, "slack": {"llama": {"activations": 0.5, "logit_grads": 2.0, "ends": 3.0}}}))
    HM._cpu_mem.cache_clear()
    hw = H.cpu_here(2)
    big = replace(llama_planner_model("small", 128), vocab=40_000)        # V·h·4 = 39 MiB, b·s·V·4 = 39 MiB at b·s = 256
    mem = PM.memory(big, 128, Layout(1, 1, 2, mb=2), 8, hw)
    assert mem["allocator"] == pytest.approx(0.5 * mem["activations"])
    seven = PM.memory(PRESETS["llama-7b"], 4096, Layout(1, 1, 2, mb=1), 8, hw)
    assert seven["allocator"] == 0.0 and seven["activations"] > 1e9


def test_an_incomplete_llama_fit_is_refused(probed):
    data = json.loads(probed.read_text())
    probed.write_text(json.dumps({**data, "slack": {"llama": {"per_activation": 0.5}}}))
    HM._cpu_mem.cache_clear()
    with pytest.raises(ValueError, match="lacks.*planner_mem_probe"):
        PM.memory(llama_planner_model("small", 128), 128, Layout(1, 1, 2, mb=2), 8, H.cpu_here(2))


def test_the_slack_probe_reads_each_stages_blocks():
    """benchmarks.planner_mem_probe fits each rank against the blocks planner.memory counts for its
    stage: the first without logits, the last with them, and planner.memory left as it was."""
    from benchmarks.planner_mem_probe import stage_blocks
    small = llama_planner_model("small", 128)
    got = stage_blocks(small, Layout(1, 1, 2, mb=2), 8)
    assert set(got) == {"first", "last"} and all(set(b) == set(HM.SLACK_BLOCKS) for b in got.values())
    assert got["first"]["logit_grads"] == 0.0 < got["last"]["logit_grads"]
    assert got["first"]["activations"] > got["last"]["activations"]            # two micro-batches in flight
    assert PM.allocator_slack is HM.allocator_slack


def test_the_slack_probes_check_refuses_the_flags_it_ignores(capsys):
    from benchmarks.planner_mem_probe import main
    with pytest.raises(SystemExit) as e:
        main(["--vocab", "4096", "--engines"])
    assert e.value.code == 2 and "--vocab" in capsys.readouterr().err


def test_the_shipped_llama_factors_are_probed():
    """The cpu_mem.json the planner reads, as benchmarks.planner_mem_probe writes it: llama's factors and where they were fitted."""
    from benchmarks.planner_mem_probe import LLAMA_SLACK, SLACK_MBS, SLACK_VOCABS
    with open(HM.CPU_MEM) as f:
        got = json.load(f)["slack"]["llama"]
    assert all(0.0 < got[k] < 10.0 for k in HM.SLACK_BLOCKS)
    assert got["micro_batches"] == list(SLACK_MBS) and got["vocabularies"] == list(SLACK_VOCABS)
    assert got["shape"] == {k: v for k, v in LLAMA_SLACK.items() if k != "vocab_size"}
    assert LLAMA_SLACK["hidden_size"] not in (64, 256)        # not a row's preset (tiny, small)


def test_mapped_blocks_keep_no_slack():
    hw = replace(H.cpu_here(2), alloc_slack=50.0 * MiB)
    sw = Software(mapped_alloc=True)
    assert PM.memory(GPT, 128, Layout(2, 1, 1, mb=4), 8, hw, sw)["allocator"] == 0.0
    assert PM.memory(GPT, 128, Layout(2, 1, 1, zero=3, mb=4), 8, hw)["allocator"] == 0.0


def test_parts_of_a_measured_peak():
    base = {"RssFile": 100 * MiB, "RssShmem": 0, "VmRSS": 500 * MiB, "arena": 10 * MiB, "hblkhd": 0, "threads": 3}
    step = {"RssFile": 103 * MiB, "RssShmem": 4 * MiB, "VmHWM": 540 * MiB, "arena": 30 * MiB, "fordblks": 5 * MiB,
            "hblkhd": 2 * MiB, "threads": 9}
    p = parts({"base": base, "steps": [step], "peak": 40 * MiB, "arenas": [30 * MiB]})
    assert (p["file"], p["shm"], p["anon"], p["heap"], p["mapped"], p["threads"]) == (3.0, 4.0, 33.0, 20.0, 2.0, 6)
    assert p["file"] + p["shm"] + p["anon"] == p["peak"] and p["step peaks"] == "40"


@pytest.mark.parametrize("mb", [None, 8])
def test_slack_rows_run_the_layout_the_planner_is_given(mb):
    """benchmarks.planner_slack --mb: each row's ranks run the micro-batch and micro-batch count
    of the Layout and global batch its planner count is made for."""
    from benchmarks.planner_slack import rows
    where = {"_rank": (1, None), "_pp_rank": (1, 2), "_tp_rank": (2, None), "_llama_pp_rank": (2, 3), "_tp_pp_rank": (2, 3)}
    for name, m, lay, batch, module, fn, args in rows(3, mb):
        at, micro = where[fn]
        assert args[at] == lay.mb == (mb or lay.mb), name
        assert lay.micro_batches(batch) == (args[micro] if micro else 1), name
        assert args[-1] == 3 or args[-2] == 3, name      # the steps


def test_repredict_reads_a_recorded_run_back(tmp_path, capsys):
    """benchmarks.planner_local --repredict: a row predicted again from the probe's reading it
    recorded gives the recorded prediction when nothing changed, against the recorded measurement."""
    from benchmarks.planner_local import predicted, repredict, runs
    from planner.hosts import fitted_on
    m, label, lay, batch, fn, _ = runs(True, 3)[0]
    p = predicted(m, label, lay, batch, False, 1.0, 0.5, 0.9)[2]
    mem = p.memory["total"] - p.memory["reserved"]
    row = {"model": m.name, "layout": label, "load": 1.0, "wake": 0.5, "speed": 0.9, "step_pred": p.time["total"],
           "step_meas": p.time["total"] / 1.2, "mem_pred": mem, "mem_meas": mem / 0.95}
    path = tmp_path / "rows.json"
    hw = H.cpu_here()
    rate = hw.peak_flops * hw.gemm_efficiency
    here = fitted_on(H.CPU_HERE)
    for bad in ({"cpu": "Elsewhere CPU (family 6, model 1, stepping 0, 2 cores)", "fit": {"rate": rate}},  # measured elsewhere
                {"fit": {"rate": rate}}, {"cpu": here}):         # a row that names no processor, or no fit's rate
        path.write_text(json.dumps([{**row, **bad}]))
        with pytest.raises(SystemExit, match="Elsewhere CPU" if "Elsewhere" in str(bad) else "None"):
            repredict(str(path))
    row.update(cpu=here, fit={"cpu": "another fit of this processor", "rate": rate / 2})   # at half this fit's rate:
    path.write_text(json.dumps([{**row, "speed": 1.8}]))                                  # its 1.8 is 0.9 of this fit's
    repredict(str(path))
    assert "+20% → +20%" in capsys.readouterr().out
    row["fit"]["rate"] = rate
    path.write_text(json.dumps([row]))
    repredict(str(path))
    out = capsys.readouterr().out
    assert "+20% → +20%" in out and "-5% → -5%" in out
    # with a reading after the row, the speed over it is the two readings' harmonic mean
    from benchmarks.planner_local import row_speed
    assert row_speed(0.5, 1.0) == pytest.approx(2 / 3) and row_speed(0.9, None) == 0.9
    slow = predicted(m, label, lay, batch, False, 1.0, 0.5, row_speed(0.9, 0.45))[2].time["total"]
    path.write_text(json.dumps([{**row, "after": {"speed": 0.45}}]))
    repredict(str(path))
    assert f"+20% → {slow / row['step_meas'] - 1:+.0%}" in capsys.readouterr().out and slow > p.time["total"]


def test_runs_judge_memory_at_the_median_of_the_runs_and_list_each_runs_misses(tmp_path, capsys):
    """benchmarks.planner_local --runs: the same row in three runs, measured 0.85, 1.0 and 1.2 of the
    prediction: each run's errors, the memory error against the median measurement, and the misses of
    each run (memory beyond 10 %, step beyond 25 %) named with the run, how many sets of k runs
    hold every row at their medians, and the spread of ln(slack) between the ranks of one run."""
    from benchmarks.planner_local import main, predicted, runs
    from planner.hosts import fitted_on
    m, label, lay, batch, fn, _ = runs(True, 3)[0]
    p = predicted(m, label, lay, batch, False, 1.0, 0.5, 0.9)[2]
    mem = p.memory["total"] - p.memory["reserved"]
    hw = H.cpu_here()
    row = {"model": m.name, "layout": label, "load": 1.0, "wake": 0.5, "speed": 0.9, "step_pred": p.time["total"],
           "step_meas": p.time["total"], "mem_pred": mem, "cpu": fitted_on(H.CPU_HERE),
           "fit": {"rate": hw.peak_flops * hw.gemm_efficiency}}
    count, slack = mem - p.memory["allocator"], p.memory["allocator"]
    ranks = [count + slack * math.exp(0.1), count + slack * math.exp(-0.1)]     # ln(slack) 0.2 apart: σ √0.02
    paths = []
    for i, f in enumerate((0.85, 1.0, 1.2)):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps([{**row, "mem_meas": mem * f, "step_meas": p.time["total"] * (1.5 if i == 2 else 1.0),
                                          "mem_per_rank": ranks}]))
    assert main(["--runs", *map(str, paths)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "+17.6% +0.0% -16.7%" in out
    with pytest.raises(SystemExit) as e:
        main(["--runs", str(paths[0]), "--repredict", str(paths[0])])
    assert e.value.code == 2
    assert f"{m.name} {label} (run 1: memory)" in out and f"{m.name} {label} (run 3: step and memory)" in out
    assert "memory beyond 10 % of the runs' median: none" in out
    # alone, only the second run holds; the three together hold at their medians (step 0 %, memory 0 %)
    assert "sets of k runs whose medians hold every row (step ≤ 25 %, memory ≤ 10 %): 1: 1 of 3, 3: 1 of 1" in out
    assert f"within a run (the fit's, from launch to launch: {hw.slack_sigma:.3f}): {m.name} {label} 0.141" in out
    assert f"no single figure meets within 10 % in every run (least_worst): {m.name} {label} (" in out     # 0.85-1.2: ±17 %
    with pytest.raises(SystemExit) as e:
        main(["--runs", str(tmp_path / "absent.json")])
    assert e.value.code == 2


def test_slack_replay_counts_the_logged_blocks(tmp_path):
    """benchmarks.planner_slack_replay.replay: a logged malloc, a 64-byte memalign, a realloc and
    frees, replayed each way; the live bytes at the peak are the logged sizes'."""
    import numpy as np
    from benchmarks.planner_slack_replay import replay
    MiB = 2**20
    log = np.array([[1, MiB, 0x1000, 0], [4, 2 * MiB, 0x2000, 64], [3, 3 * MiB, 0x3000, 0x1000],
                    [2, 0, 0x2000, 0], [1, 1000, 0x4000, 0], [2, 0, 0x3000, 0], [2, 0, 0x4000, 0]], dtype=np.uint64)
    path = str(tmp_path / "log.bin")
    log.tofile(path)
    assert replay([path], "logged")[0][1] == 5 * MiB      # the realloc's 3 MiB with the memalign's 2
    assert replay([path], "unaligned")[0][1] == 5 * MiB
    assert replay([path], "nosmall")[0][1] == 5 * MiB     # the 1000-byte block is left out, not the peak
    assert replay([path, path], "logged")[1][1] == 5 * MiB
    assert replay([path], "logged", risen=True)[0][1] == 5 * MiB     # the threshold raised first: the same blocks


def test_slack_replay_stops_at_the_live_peak(tmp_path):
    """benchmarks.planner_slack_replay --holes: live_peak counts the calls up to the last file's
    highest live bytes, and a replay stopped there (in a fresh process, as the benchmark runs it)
    returns the heap's free chunks as (smallest size, count, bytes) per bin. Which chunks a fresh
    interpreter's heap already holds varies from run to run (measured: the free bytes after the
    same calls differ by more than the 96 KiB block), so no test asserts the hole itself."""
    import numpy as np
    from benchmarks.planner_slack_replay import live_peak
    K = 96 * 1024
    log = np.array([[1, K, 0x1000, 0], [1, K, 0x2000, 0], [1, K, 0x3000, 0], [2, 0, 0x2000, 0],
                    [2, 0, 0x1000, 0], [2, 0, 0x3000, 0]], dtype=np.uint64)
    path = str(tmp_path / "log.bin")
    log.tofile(path)
    assert live_peak([path]) == 3 and live_peak([path, path]) == 6 + 3
    out = subprocess.run([sys.executable, "-m", "benchmarks.planner_slack_replay", "--replay", "logged", "-", "4",
                          path], check=True, capture_output=True, text=True).stdout
    chunks = json.loads(out)
    assert chunks and all(len(c) == 3 and c[0] > 0 and c[1] >= 1 and c[2] >= c[0] * c[1] for c in chunks), chunks


def test_eager_adam_makes_the_same_updates():
    """benchmarks.planner_slack --eager: torch's Adam/AdamW with its state made when built steps
    bit for bit as the lazily made one (the same zeros, the same step counter)."""
    import copy
    import torch
    from benchmarks import planner_slack
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    twin = copy.deepcopy(net)
    lazy = torch.optim.AdamW(net.parameters(), lr=1e-2)
    init = torch.optim.Adam.__init__
    try:
        planner_slack._eager_adam()
        eager = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    finally:
        torch.optim.Adam.__init__ = init
    assert len(eager.state) == 4 and not lazy.state
    x = torch.randn(5, 8)
    for _ in range(3):
        for n, o in ((net, lazy), (twin, eager)):
            n(x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), twin.parameters()))
    assert all(torch.equal(lazy.state[a]["exp_avg_sq"], eager.state[b]["exp_avg_sq"])
               for a, b in zip(net.parameters(), twin.parameters()))


def test_reuse_variant_keeps_gradients_and_makes_the_same_updates():
    """benchmarks.planner_slack --variant reuse: the step zeroes the gradients in place and the next
    backward accumulates into the same storage; the parameters are those of dropping them (set_to_none),
    bit for bit, over steps of several micro-batches; undo restores torch's zero_grad and the executor."""
    import copy
    import torch
    import pipeline_parallel.executor as X
    from benchmarks import planner_slack
    from pipeline_parallel.engine.draining import DrainingExecutor
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    twin = copy.deepcopy(net)
    dropped, kept = torch.optim.AdamW(net.parameters(), lr=1e-2), torch.optim.AdamW(twin.parameters(), lr=1e-2)
    before = X.torch, DrainingExecutor.bwd, torch.optim.Optimizer.zero_grad
    xs = torch.randn(3, 5, 8)
    for _ in range(3):
        for x in xs:
            net(x).pow(2).sum().backward()
        dropped.step()
        dropped.zero_grad(set_to_none=True)
    undo = planner_slack._reuse_blocks()
    try:
        ptrs = []
        for _ in range(3):
            for x in xs:
                twin(x).pow(2).sum().backward()
            ptrs.append([p.grad.data_ptr() for p in twin.parameters()])
            kept.step()
            kept.zero_grad(set_to_none=True)      # the engine's call: zeroed in place under the variant
        assert X.torch.empty((2, 3), dtype=torch.float32).shape == (2, 3)
    finally:
        undo()
    assert ptrs[0] == ptrs[1] == ptrs[2]
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), twin.parameters()))
    assert (X.torch, DrainingExecutor.bwd, torch.optim.Optimizer.zero_grad) == before


@pytest.mark.slow
def test_a_fixed_hash_seed_and_address_layout_give_one_process_the_same_peak():
    """benchmarks.planner_slack_seeds: the allocator's slack is set at launch. One process with
    PYTHONHASHSEED and an unrandomized address space peaks at the same resident set twice (within
    1 MiB: the kernel's resident-set counters are per-CPU batches of up to 64 pages per CPU)."""
    import shutil
    from benchmarks.planner_slack_seeds import launch
    if shutil.which("setarch") is None:
        pytest.skip("setarch (util-linux) not installed: the fixed launches run under setarch -R")
    first, again = (launch("gpt-mini", 2, "alone", 1) for _ in range(2))
    assert abs(first - again) <= 2**20, (first, again)


def test_the_slack_fit_is_the_median_launch_less_the_planners_count(monkeypatch):
    """benchmarks.planner_fit_engine.slack_fit: each launch is a fresh interpreter of the calibration
    shape's DDP row (its own draw of the slack); alloc_slack is the median of the launches' peaks
    less the planner's count without slack, a launch under the count giving 0, not a negative slack."""
    from benchmarks import planner_fit_engine as FE
    hw = H.cpu_here(2)
    pred = PM.memory(CAL, CAL.seq, Layout(2, 1, 1, mb=4), 8, replace(hw, alloc_slack=0.0))
    count = pred["total"] - pred["reserved"]
    peaks = iter([count + 60 * MiB, count - 5 * MiB, count + 40 * MiB, count + 90 * MiB, count + 50 * MiB])
    calls = []
    monkeypatch.setattr(FE, "launch", lambda shape, steps, mode, seed: calls.append((shape, steps, mode, seed)) or next(peaks))
    doc = {"alloc_slack": hw.alloc_slack}
    monkeypatch.setattr(FE, "cpu_here", lambda n, fitted: replace(hw, alloc_slack=fitted["alloc_slack"]))
    got, each = FE.slack_fit(doc, launches=5)
    assert calls == [(CAL.name, 4, "ranks", None)] * 5     # a random seed each, as Python starts
    assert each == pytest.approx([60 * MiB, 0.0, 40 * MiB, 90 * MiB, 50 * MiB]) and got == pytest.approx(50 * MiB)


def test_the_pipeline_slack_fit_is_the_median_launch_per_byte_of_the_stages_largest_block(monkeypatch):
    """benchmarks.planner_fit_engine.pipe_slack_fit: PIPE_CAL's pipeline in fresh interpreters; the
    median slack over the heavier stage's largest freed block (its logits, 15.6 MiB)."""
    from benchmarks import planner_fit_engine as FE
    hw = H.cpu_here(2)
    lay = Layout(1, 1, 2, mb=2)
    pred = PM.memory(HM.PIPE_CAL, 128, lay, 8, replace(hw, alloc_slack=0.0, pipe_slack=0.0))
    count = pred["total"] - pred["reserved"] - pred["allocator"]
    big = 4 * 2 * 128 * HM.PIPE_CAL.vocab
    assert pred["stage"] == "last" and big < HM.GLIBC_MMAP_MAX
    peaks = iter([count + 6 * big, count + 8 * big, count + 7 * big])
    calls = []
    monkeypatch.setattr(FE, "launch", lambda shape, steps, mode, seed: calls.append((shape, mode, seed)) or next(peaks))
    monkeypatch.setattr(FE, "cpu_here", lambda n, fitted: replace(hw, **{k: fitted[k] for k in ("alloc_slack", "pipe_slack")}))
    got, each = FE.pipe_slack_fit({"alloc_slack": 0.0, "pipe_slack": 0.0}, launches=3)
    assert calls == [(HM.PIPE_CAL.name, "pipe", None)] * 3
    assert got == pytest.approx(7.0) and each == pytest.approx([6 * big, 8 * big, 7 * big])


def test_zeros_reduce_scatter_scratch_is_one_piece_per_ring_step_up_to_two():
    """zero_from_scratch's ring reduce-scatter writes comm.scratch's slots in turn, one per step of
    N − 1, each a block 4u/N or the engine's 1 MiB piece when smaller: 0, 1 and 2 pieces at N = 1, 2, 3."""
    from zero_from_scratch.engine.comm import RS_PIECE_BYTES
    hw = replace(H.cpu_here(2), alloc_slack=0.0)
    got = {}
    for n in (1, 2, 3):
        lay = Layout(n, 1, 1, zero=1, mb=4)
        one = PM.memory(GPT, 128, lay, 4 * n, hw)
        piece = min(4 * PM.zero_unit(GPT, lay, PM.stage_params(GPT, lay, "first")) / n, RS_PIECE_BYTES)
        got[n] = one["working"] - PM.torch_head_bytes(GPT, 128, lay)[1] - PM.shm_bytes(GPT, 128, lay, hw, piece)
    assert got == pytest.approx({1: 0.0, 2: RS_PIECE_BYTES, 3: 2 * RS_PIECE_BYTES})


def test_the_replays_and_the_across_benchmark_refuse_the_flags_they_would_ignore(capsys):
    """--runs and --repredict run nothing, so a row filter or a step count beside them is refused;
    planner_slack_across's child flags are refused without --child."""
    from benchmarks.planner_local import main as local
    from benchmarks.planner_slack_across import main as across
    for argv in (["--runs", __file__, "--only", "pp2"], ["--repredict", __file__, "--steps", "3"]):
        with pytest.raises(SystemExit) as e:
            local(argv)
        assert e.value.code == 2 and "runs nothing" in capsys.readouterr().err
    for argv in (["--steps", "2"], ["--case", "4096,4,1"], ["--child", "pipe"]):
        with pytest.raises(SystemExit) as e:
            across(argv)
        assert e.value.code == 2
