# The Hugging Face suites' own files (upstream/) run only through tests/hf_suites/run.py, each rooted at its
# repository's copy; the repository's suite does not collect them (tests/test_hf_suites.py drives them).
collect_ignore = ["upstream", "local"]
