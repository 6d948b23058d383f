"""Every picture the tutorials show, drawn by code from the project's own measurements.

    make figures                   # = python -m figures
    python -m figures ch04_zero_memory

One module per chapter (chNN_topic.py), each with main() -> list of PNG paths under
tutorials/img/. See figures/common.py for the stamp and metadata each PNG carries.
"""
