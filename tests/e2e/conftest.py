"""tests/e2e holds runners for a real node (root, ../shared/realk8s, minutes per run),
started by hand: `python -m tests.e2e.kit_restarts` (see README.md). The default
`pytest` run must never collect or import them."""

collect_ignore_glob = ["*.py"]
