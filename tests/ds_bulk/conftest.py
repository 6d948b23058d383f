# DeepSpeed's own test files (upstream/) run only through tests/ds_bulk/run.py, with DeepSpeed's conftest
# and pytest.ini as their root; the repository's suite does not collect them (tests/test_ds_bulk.py drives them).
collect_ignore = ["upstream"]
