"""planner.hosts: each processor's fitted files in a folder of its own; `cpu-here` reads the folder
of the processor it runs on, else the shipped one, saying so once; a fit writes this processor's."""
import json
import os

import pytest

from planner import hosts as HO

CPUS = {"Intel(R) Xeon(R) Processor (family 6, model 207, stepping 2, 2 cores)": "intel-xeon-processor-f6-m207-s2-2c",
        "AMD EPYC (family 25, model 1, stepping 1, 2 cores)": "amd-epyc-f25-m1-s1-2c",
        "AMD EPYC 7763 64-Core Processor (family 25, model 1, stepping 1, 16 cores)":
            "amd-epyc-7763-64-core-processor-f25-m1-s1-16c",
        "Arm (implementer 0x41, part 0xd0c, revision 1, 16 cores)": "arm-implementer-0x41-part-0xd0c-revision-1-16c"}


@pytest.mark.parametrize("cpu, folder", CPUS.items())
def test_slug_names_a_processor_by_its_numbers(cpu, folder):
    assert HO.slug(cpu) == folder


def test_the_shipped_fit_is_in_the_repository():
    for name in ("cpu_here.json", "cpu_mem.json"):
        path = os.path.join(HO.CPUS, HO.SHIPPED, name)
        with open(path) as f:
            assert HO.slug(json.load(f)["cpu"]) == HO.SHIPPED, f"{path} was fitted on another processor"


SINCE = {"slice_cpu", "slice_fit", "slack_fit", "pipe_slack", "zero1_slack", "zero2_slack", "slack_sigma"}     # a term fitted after some files were: where absent, 0 (no term)


def test_every_folder_holds_its_own_processors_fit():
    """Each folder's files name the folder's processor, its cpu_here.json loads as a CPU host with the
    shipped fit's fields, and its cpu_mem.json holds llama's slack factors as the probe writes them."""
    from benchmarks.planner_mem_probe import SLACK_MBS, SLACK_VOCABS
    from planner import hardware as H
    from planner import host_memory as HM
    with open(os.path.join(HO.CPUS, HO.SHIPPED, "cpu_here.json")) as f:
        fields = set(json.load(f)) - SINCE

    for folder in os.listdir(HO.CPUS):
        for name in ("cpu_here.json", "cpu_mem.json"):
            with open(os.path.join(HO.CPUS, folder, name)) as f:
                doc = json.load(f)
            assert HO.slug(doc["cpu"]) == folder, (folder, name)
            if name == "cpu_here.json":
                assert fields <= set(doc) <= fields | SINCE, (folder, set(doc) ^ fields)
                hw = H.cpu_here(2, fitted=doc)
                assert hw.peak_flops > 1e9 and hw.elementwise_s > 0 and hw.llama_elementwise_s > 0 and hw.wait_s >= 0
            else:
                llama = doc["slack"]["llama"]
                assert all(0.0 < llama[k] < 10.0 for k in HM.SLACK_BLOCKS), folder
                assert llama["micro_batches"] == list(SLACK_MBS) and llama["vocabularies"] == list(SLACK_VOCABS)
                # the ZeRO engine's own runtime ("zero") where the probe that measures it ran
                assert set(doc["runtime"]) - {"zero"} == {"torch", "distilbert", "llama"}, folder


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """planner.hosts on an AMD EPYC whose folder is tmp_path/CPUS/amd-epyc-f25-m1-s1-2c."""
    monkeypatch.setattr(HO, "CPUS", str(tmp_path))
    monkeypatch.setattr(HO, "this_cpu", lambda: "AMD EPYC (family 25, model 1, stepping 1, 2 cores)")
    monkeypatch.setattr(HO, "_WARNED", set())
    (tmp_path / HO.SHIPPED).mkdir()
    return tmp_path / "amd-epyc-f25-m1-s1-2c"


def test_this_processors_folder_else_the_shipped_one(elsewhere, capsys):
    """fitted_path reads this processor's file where its folder has it, the shipped processor's
    otherwise (file by file); check_cpu says so once per file, naming both processors and this one's folder."""
    shipped = elsewhere.parent / HO.SHIPPED
    assert HO.fitted_path("cpu_here.json") == str(shipped / "cpu_here.json")
    elsewhere.mkdir()
    (elsewhere / "cpu_here.json").write_text("{}")
    assert HO.fit_path("cpu_here.json") == HO.fitted_path("cpu_here.json") == str(elsewhere / "cpu_here.json")
    assert HO.fitted_path("cpu_mem.json") == str(shipped / "cpu_mem.json"), "file by file"
    xeon = "Intel(R) Xeon(R) Processor (family 6, model 207, stepping 2, 2 cores)"
    HO.check_cpu("x.json", xeon)
    err = capsys.readouterr().err
    assert "x.json" in err and "Xeon" in err and "AMD EPYC" in err and str(elsewhere) in err and "planner_mem_probe" in err
    HO.check_cpu("x.json", xeon)
    HO.check_cpu("z.json", HO.this_cpu())
    assert not capsys.readouterr().err, "once per file, nothing for this processor's"
    HO.check_cpu("y.json", xeon)
    assert "y.json" in capsys.readouterr().err, "another file is named too"


def test_a_fit_writes_this_processors_folder(elsewhere, capsys):
    """planner_fit's --out defaults to this processor's file, its folder made at the write; a partial
    refit there before a whole fit is refused, naming the file, and makes no folder; planner_mem_probe
    refuses a cpu_mem.json it could not write before it probes."""
    from benchmarks import planner_fit, planner_mem_probe
    with pytest.raises(SystemExit) as e:
        planner_fit.main(["--loss"])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and f"{elsewhere / 'cpu_here.json'} does not exist: a partial refit" in err, err
    assert not elsewhere.exists(), "a refused refit makes no folder"
    assert HO.writable(HO.fit_path("cpu_here.json"))
    deeper = elsewhere.parent / "no-such" / "deeper" / "cpu_here.json"
    assert not HO.writable(str(deeper)), "only a processor's folder is made"
    with pytest.raises(OSError):
        HO.write_fit(str(deeper), {})
    assert not deeper.parent.parent.exists()
    HO.write_fit(HO.fit_path("cpu_here.json"), {"cpu": HO.this_cpu()})
    assert HO.fitted_on(str(elsewhere / "cpu_here.json")) == HO.this_cpu()
    (elsewhere / "cpu_mem.json").mkdir()                     # not a file it could write
    assert not HO.writable(HO.fit_path("cpu_mem.json"))
    with pytest.raises(SystemExit) as e:
        planner_mem_probe.main([])
    assert e.value.code == 2 and "cpu_mem.json: expected a file in a writable folder" in capsys.readouterr().err


def test_cpu_here_plans_with_this_machines_cores_and_memory():
    """The rates are a processor's; the cores a rank shares and the memory it plans against are the
    machine's, whichever processor's fit is read."""
    from planner import hardware as H
    with open(H.CPU_HERE) as f:
        doc = json.load(f)
    hw = H.cpu_here(2, fitted={**doc, "cores": 99, "memory": 1.0})
    assert hw.cores == os.cpu_count() and hw.memory == HO.rank_memory() > 2**30
