"""What a learner sees when a runnable script is misused: a usage error at parsing, and one line
per rank naming the valid range."""
from conftest import ROOT, run_cmd


def test_unknown_algorithm_is_refused_at_parsing():
    r = run_cmd("python primitives/allreduce.py --algorithms ring,nonsense", check=False)
    assert r.returncode == 2
    assert "'nonsense' is not a all_reduce algorithm" in r.stderr and "rabenseifner" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_root_one_line_per_rank_with_the_range():
    from primitives.launch import free_port
    r = run_cmd(f"torchrun --standalone --nproc_per_node 2 --master_port {free_port()} primitives/run.py scatter --root 5",
                check=False, timeout=120)
    assert r.returncode != 0
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "--root 5 is out of range" in ln]
    # torchrun stops the other rank as soon as one exits, so one or both lines appear; each whole
    assert lines and all(ln.count("out of range") == 1 for ln in lines), lines
    assert all(ln.startswith(("rank 0: ", "rank 1: ")) and ln.endswith("expected 0 ≤ root ≤ 1") for ln in lines), lines

