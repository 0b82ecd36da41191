"""``quantkit inspect DIR``: what a checkpoint holds."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer

from quantkit.cli.options import Json


def register(app: typer.Typer) -> None:
    @app.command("inspect")
    def inspect(path: Annotated[Path, typer.Argument(metavar="DIR", help="A quantized checkpoint folder.")],
                json_: Json = False,
                layers: Annotated[bool, typer.Option("--layers", help="List every quantized linear.")] = False,
                kernels: Annotated[bool, typer.Option(
                    "--kernels", help="Which W4A16 kernel and config each linear runs at M = 1, 16, 2048, and which "
                    "attention kernel prefill and decode run: on this machine's GPU, else the H200 table. q/k/v and gate/up "
                    "appear fused when the runtime fuses them.")
                ] = False) -> None:
        """Method, bits, group size, layers, size on disk and compression ratio of a checkpoint."""
        from rich.table import Table

        from quantkit import api
        from quantkit.cli.display import console, human_bytes

        info = api.inspect(path)
        data = info.to_dict()
        if kernels:
            from quantkit.errors import QuantkitError
            from quantkit.kernel_rows import gpu_target, runtime_layers
            from quantkit.tools.kernel_plan import explain, explain_attention

            arch, card, target = gpu_target()
            data["kernels_target"] = target
            data["kernels"] = [dataclasses.asdict(row) for row in explain(runtime_layers(path), arch=arch, card=card)]
            try:
                data["attention_kernels"] = [dataclasses.asdict(row) for row in explain_attention(path, arch=arch)]
            except QuantkitError as e:  # a model family the runtime does not serve: no attention plan
                data["attention_kernels"] = str(e)
        if json_:
            typer.echo(json.dumps(data, indent=2, default=str))
            return
        con = console()
        table = Table(title=f"{path}", show_header=False)
        for key in ("method", "quant_method", "layout", "bits", "group_size", "sym", "desc_act", "n_quantized"):
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
        if data.get("moe"):
            moe = data["moe"]
            table.add_row("experts", f"{moe['num_experts']} per block (top-{moe['top_k']}), {moe['moe_blocks']} "
                          f"blocks, {moe['packed_experts']} packed, intermediate {moe['intermediate_size']}")
            for tp, why in moe["vllm_marlin_moe_tp"].items():
                table.add_row(f"vLLM Marlin MoE tp={tp}", why)
        if data.get("calibration"):
            table.add_row("calibration", json.dumps(data["calibration"]))
        con.print(table)
        if layers and data.get("quantized"):
            lt = Table("linear", "in", "out", "groups")
            lt.columns[0].overflow = "fold"
            from quantkit.kernel_rows import natural_key

            for row in sorted(data["quantized"], key=lambda r: natural_key(str(r.get("name")))):
                lt.add_row(str(row.get("name")), str(row.get("in_features")), str(row.get("out_features")),
                           str(row.get("n_groups", "")))
            con.print(lt)
        if kernels:
            kt = Table(title=f"W4A16 kernels, {data['kernels_target']}")
            for column in ("linear", "out x in", "M", "kernel", "config", "why"):
                kt.add_column(column, overflow="fold")  # whole names and numbers, wrapped if need be
            for row in data["kernels"]:
                kt.add_row(row["name"], f"{row['out_features']} x {row['in_features']}", str(row["m"]), row["kernel"],
                           row["config"], row["reason"])
            con.print(kt)
            if isinstance(data["attention_kernels"], str):
                con.print(f"attention: {data['attention_kernels']}")
            else:
                at = Table(title=f"attention kernels, {data['kernels_target']}")
                for column in ("phase", "query tokens", "layers", "kernel", "why"):
                    at.add_column(column, overflow="fold")
                for row in data["attention_kernels"]:
                    at.add_row(row["phase"], str(row["tokens"]), row["layers"], row["kernel"], row["reason"])
                con.print(at)
