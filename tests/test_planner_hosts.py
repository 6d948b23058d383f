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


def test_every_folder_holds_its_own_processors_fit():
    """A folder's files say which processor fitted them, and it is the folder's."""
    for folder in os.listdir(HO.CPUS):
        for name in os.listdir(os.path.join(HO.CPUS, folder)):
            with open(os.path.join(HO.CPUS, folder, name)) as f:
                assert HO.slug(json.load(f)["cpu"]) == folder, (folder, name)


def test_this_processors_folder_else_the_shipped_one(tmp_path, monkeypatch, capsys):
    """fitted_path reads this processor's file where its folder has it, the shipped processor's
    otherwise (file by file); check_cpu says once, naming both processors and this one's folder."""
    monkeypatch.setattr(HO, "CPUS", str(tmp_path))
    monkeypatch.setattr(HO, "this_cpu", lambda: "AMD EPYC (family 25, model 1, stepping 1, 2 cores)")
    monkeypatch.setattr(HO, "_WARNED", set())
    (tmp_path / HO.SHIPPED).mkdir()
    assert HO.fitted_path("cpu_here.json") == str(tmp_path / HO.SHIPPED / "cpu_here.json")
    mine = tmp_path / "amd-epyc-f25-m1-s1-2c"
    mine.mkdir()
    (mine / "cpu_here.json").write_text("{}")
    assert HO.fit_path("cpu_here.json") == HO.fitted_path("cpu_here.json") == str(mine / "cpu_here.json")
    assert HO.fitted_path("cpu_mem.json") == str(tmp_path / HO.SHIPPED / "cpu_mem.json"), "file by file"
    HO.check_cpu("x.json", "Intel(R) Xeon(R) Processor (family 6, model 207, stepping 2, 2 cores)")
    err = capsys.readouterr().err
    assert "x.json" in err and "Xeon" in err and "AMD EPYC" in err and str(mine) in err and "planner_mem_probe" in err
    HO.check_cpu("y.json", "Intel(R) Xeon(R) Processor (family 6, model 207, stepping 2, 2 cores)")
    HO.check_cpu("z.json", "AMD EPYC (family 25, model 1, stepping 1, 2 cores)")
    assert not capsys.readouterr().err, "once per processor, nothing for this one"


def test_a_whole_fit_writes_this_processors_folder(tmp_path, monkeypatch):
    """planner_fit's --out and planner_mem_probe's file default to this processor's folder, made at
    the write (a partial refit into a folder that is not there is refused, naming the file)."""
    from benchmarks import planner_fit
    monkeypatch.setattr(HO, "CPUS", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        planner_fit.main(["--loss"])
    assert e.value.code == 2 and not os.listdir(tmp_path), "a refused refit makes no folder"
    planner_fit.write_json(HO.fit_path("cpu_here.json"), {"cpu": HO.this_cpu()})
    assert os.listdir(tmp_path) == [HO.slug(HO.this_cpu())]
