"""What each runtime dependency costs in the image, in MB on disk (BENCHMARKS.md).

    pip install --no-cache-dir --target DIR -c constraints.txt .
    python -m bench.image_sizes DIR

Sums the files each distribution's RECORD lists (bytecode included, as pip
compiles it at install time) and prints a Markdown table, largest first.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path


def sizes(root: Path) -> list[tuple[int, int, str]]:
    """(bytes, bytes of .pyc, "name version") per distribution installed under root."""
    rows = []
    for dist in metadata.distributions(path=[str(root)]):
        total = pyc = 0
        for file in dist.files or []:
            path = root / file
            if path.is_file():
                size = path.stat().st_size
                total += size
                pyc += size if path.suffix == ".pyc" else 0
        rows.append((total, pyc, f"{dist.metadata['Name']} {dist.version}"))
    return sorted(rows, reverse=True)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python -m bench.image_sizes DIR (a pip --target directory)", file=sys.stderr)
        return 2
    rows = sizes(Path(argv[0]))
    print("| Distribution | MB on disk | of which .pyc |\n|---|---:|---:|")
    for total, pyc, name in rows:
        print(f"| {name} | {total / 1e6:.1f} | {pyc / 1e6:.1f} |")
    print(f"| all {len(rows)} | {sum(r[0] for r in rows) / 1e6:.1f} | ", end="")
    print(f"{sum(r[1] for r in rows) / 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
