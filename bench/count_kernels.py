"""Size of a kernels/ folder: lines, jit kernels, shipped configs, module constants and public parameters.

    python bench/count_kernels.py [KERNELS_DIR ...] [--exclude a.py,b.py]   (default: kernels)

``--exclude`` leaves files out by name, e.g. to compare the families a past version had with today's (the kernels
other issues added since: ``gemv.py,gptq_solve.py,awq_clip.py,awq_fake_quant.py``).

* kernels: top-level ``@triton.jit`` / ``@gluon.jit`` functions whose name ends in ``_kernel`` (launch targets);
* configs: config objects written in the source (``triton.Config``, ``GluonConfig(...)``, the ``_cfg`` helpers,
  the family dataclasses) plus the distinct configs of a shipped ``*.json`` table;
* constants: module-level UPPER_CASE assignments;
* public parameters: parameters of public (no leading ``_``) module-level functions and methods.
Run it on two checkouts to compare (``git worktree`` or a copy of main's kernels/).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

CONFIG_CALLS = {"Config", "GluonConfig", "_cfg", "_gemv_cfg", "_pairs_cfg", "G", "GemvConfig", "PairsConfig",
                "TcConfig"}


def _name(node) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def count(folder: Path, exclude: frozenset = frozenset()) -> dict:
    out = dict(lines=0, files=0, kernels=0, configs=0, constants=0, public_params=0, run_comments=0)
    for path in sorted(p for p in folder.glob("*.py") if p.name not in exclude):
        text = path.read_text()
        out["files"] += 1
        out["lines"] += text.count("\n")
        out["run_comments"] += sum(1 for line in text.splitlines() if "run " in line.lower() and any(
            ch.isdigit() for ch in line.lower().split("run ", 1)[1][:3]))
        tree = ast.parse(text)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                decorators = {_name(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list}
                if decorators & {"jit"} and node.name.endswith("_kernel"):
                    out["kernels"] += 1
                if not node.name.startswith("_") and not decorators & {"jit"}:
                    out["public_params"] += len(node.args.args) + len(node.args.kwonlyargs)
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
                        out["public_params"] += max(len(item.args.args) - 1, 0) + len(item.args.kwonlyargs)
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id.lstrip("_").isupper() for t in targets):
                    out["constants"] += 1
                    if isinstance(node.value, (ast.List, ast.Tuple)):
                        out["configs"] += sum(1 for e in node.value.elts
                                              if isinstance(e, ast.Call) and _name(e.func) in CONFIG_CALLS)
    for table in folder.glob("*.json"):
        entries = json.loads(table.read_text()).get("entries", [])
        out["configs"] += len({(e["kernel"], json.dumps(e["config"], sort_keys=True)) for e in entries})
        out["table_entries"] = out.get("table_entries", 0) + len(entries)
    return out


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="*", type=Path, default=[Path("kernels")], metavar="KERNELS_DIR")
    ap.add_argument("--exclude", default="", help="file names to leave out, comma-separated")
    args = ap.parse_args(argv)
    exclude = frozenset(n for n in args.exclude.split(",") if n)
    folders = args.folders
    rows = {str(f): count(f, exclude) for f in folders}
    keys = list(next(iter(rows.values())).keys() | set().union(*rows.values()))
    keys.sort()
    print(f"{'':<28}" + "".join(f"{k:>15}" for k in keys))
    for name, row in rows.items():
        print(f"{name:<28}" + "".join(f"{row.get(k, 0):>15}" for k in keys))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
