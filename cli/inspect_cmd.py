"""``quantkit inspect DIR``: what a checkpoint holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from quantkit.cli.options import Json


def register(app: typer.Typer) -> None:
    @app.command("inspect")
    def inspect(path: Annotated[Path, typer.Argument(metavar="DIR", help="A quantized checkpoint folder.")],
                json_: Json = False,
                layers: Annotated[bool, typer.Option("--layers", help="List every quantized linear.")] = False) -> None:
        """Method, bits, group size, layers, size on disk and compression ratio of a checkpoint."""
        from rich.table import Table

        from quantkit import api
        from quantkit.cli.display import console, human_bytes

        info = api.inspect(path)
        data = info.to_dict()
        if json_:
            typer.echo(json.dumps(data, indent=2, default=str))
            return
        con = console()
        table = Table(title=f"{path}", show_header=False)
        for key in ("method", "quant_method", "bits", "group_size", "sym", "desc_act", "n_quantized"):
            if key in data:
                table.add_row(key.replace("_", " "), str(data[key]))
        for key in ("size_on_disk", "size_16bit"):
            if key in data:
                table.add_row(key.replace("_", " "), human_bytes(data[key]))
        if "compression_ratio" in data:
            table.add_row("compression ratio", f"{data['compression_ratio']:.2f}x")
        for key in ("partial_group_layers", "unquantized_modules"):
            if data.get(key):
                table.add_row(key.replace("_", " "), f"{len(data[key])}: {', '.join(map(str, data[key][:4]))}"
                              + (" ..." if len(data[key]) > 4 else ""))
        if data.get("calibration"):
            table.add_row("calibration", json.dumps(data["calibration"]))
        con.print(table)
        if layers and data.get("quantized"):
            lt = Table("linear", "in", "out", "groups")
            for row in data["quantized"]:
                lt.add_row(str(row.get("name")), str(row.get("in_features")), str(row.get("out_features")),
                           str(row.get("n_groups", "")))
            con.print(lt)
