"""Every picture the tutorials show, drawn by code from the project's own measurements.

    make figures                   # = python -m figures
    python -m figures ch04_zero_memory

One module per chapter (chNN_topic.py), each with main() -> list of PNG paths under
tutorials/img/. See figures/common.py for the stamp and metadata each PNG carries.
ELSEWHERE: the pictures the tutorials embed that another command draws (python -m figures
lists them at the end); tests/test_figures.py checks every embedded picture is one or the other.
"""

ELSEWHERE = {   # picture -> the command that redraws it, and why it is not a figures module
    "11_multinode_busbw.png": "python -m benchmarks.multinode  (needs the two-node cluster: "
                              "network namespaces and root, see multinode/; make figures runs it as root)",
}
