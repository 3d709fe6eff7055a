"""Prompt files for `specmla bench spec --dataset`: the speculative-decoding workloads (complete, edit).

`--task edit`: each prompt holds a function from the Python standard library and asks for it back with a small
change, so most of the answer repeats the prompt — the case where n-gram drafts shine.

    python benchmarks/code_edit_prompts.py --out data/code_edit.jsonl [--n 64]
    specmla bench spec --dataset data/code_edit.jsonl --modes none ngram mtp hybrid --output-len 256

`--task complete --files data/stdlib/files_heldout.txt` writes the other workload: the first lines of
functions from the embedded model's held-out files, to be completed (plain code generation).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
from pathlib import Path

EDITS = [
    "Rename the function to `{name}_v2` and keep everything else the same.",
    "Add type hints to the signature and keep the body unchanged.",
    "Add a one-line docstring and keep the body unchanged.",
    "Rewrite it with the same behaviour, changing only variable names to be more descriptive.",
]


def functions(root: Path, rng: random.Random, n: int, max_lines: int = 40,
              only: list[str] | None = None) -> list[tuple[str, str]]:
    files = sorted(root / f for f in only) if only else sorted(root.glob("*.py"))
    rng.shuffle(files)
    out = []
    for f in files:
        try:
            src = f.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and 5 <= node.end_lineno - node.lineno <= max_lines:
                out.append((node.name, ast.get_source_segment(src, node)))
                if len(out) == n:
                    return out
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="data/code_edit.jsonl")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", choices=["edit", "complete"], default="edit")
    ap.add_argument("--files", help="a file list (one stdlib-relative path per line, # comments), e.g. "
                    "data/stdlib/files_heldout.txt")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    only = None
    if args.files:
        only = [ln.strip() for ln in Path(args.files).read_text().splitlines() if ln.strip() and ln[0] != "#"]
    root = Path(sysconfig.get_paths()["stdlib"])
    if only:
        only = [f for f in only if (root / f).exists()]  # another Python's stdlib may lack a few
    fns = functions(root, rng, args.n, only=only)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for name, code in fns:
            if args.task == "complete":
                prompt = "\n".join(code.splitlines()[:3]) + "\n"
            else:
                edit = rng.choice(EDITS).format(name=name)
                prompt = f"# {edit}\n{code}\n\n# The edited version:\n"
            f.write(json.dumps({"prompt": prompt}) + "\n")
    print(f"{len(fns)} prompts → {out}")


if __name__ == "__main__":
    main()
