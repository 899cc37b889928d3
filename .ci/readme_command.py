"""Print one of the README's two set-up commands (`main` or `test`), so CI runs exactly that."""

import re
import sys
from pathlib import Path


def commands(readme: str) -> dict[str, str]:
    found = re.findall(r"<!-- setup:(\w+) -->\s*```(?:bash|sh)\n(.*?)\n```", readme, re.S)
    return {name: body.strip() for name, body in found}


if __name__ == "__main__":
    cmds = commands(Path(__file__).resolve().parent.parent.joinpath("README.md").read_text())
    if set(cmds) != {"main", "test"}:
        sys.exit(f"README must mark exactly two set-up commands (main, test); found {list(cmds)}")
    print(cmds[sys.argv[1]])
