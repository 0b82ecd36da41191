"""Adds a bench_w4a16_decode.py JSON's ``candidate_entries`` to a W4A16 table file (kernels/w4a16_h200.json form)
and prints how many it added: gpu_check.sh's ``w4a16-ab`` mode times the whole step with them before any goes into
the shipped table. An entry for a cell the table already has for that card replaces it.

    python3 bench/lib/add_table_entries.py DECODE_JSON TABLE_JSON
"""

from __future__ import annotations

import json
import sys


def add_entries(table: dict, candidates: list[dict]) -> int:
    def key(e):
        return e["n"], e["k"], e["m"], e.get("card")

    new = {key(e) for e in candidates}
    table["entries"] = [e for e in table["entries"] if key(e) not in new] + list(candidates)
    return len(candidates)


def table_text(table: dict) -> str:
    """The table in the shipped file's layout: one key a line, one entry a line (diffs stay one line an entry)."""
    head = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in table.items() if k != "entries"]
    rows = ",\n".join(f"  {json.dumps(e)}" for e in table["entries"])
    return "{\n" + ",\n".join(head) + ',\n "entries": [\n' + rows + "\n ]\n}\n"


def main(argv: list[str]) -> int:
    decode_json, table_json = argv
    with open(decode_json) as f:
        candidates = json.load(f).get("candidate_entries", [])
    with open(table_json) as f:
        table = json.load(f)
    added = add_entries(table, candidates)
    with open(table_json, "w") as f:
        f.write(table_text(table))
    print(added)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
