"""Run by torchrun from test_distributed.py: each rank quantizes the tiny model for every case, or fails.

Usage: _rank_worker.py MODEL_DIR TEXT_FILE OUT_DIR MODE   (MODE: ok | moe | raise | kill; moe: MODEL_DIR is a
tiny MoE model and the MOE_CASES run)
The work device is $QUANTKIT_TEST_DEVICE (default cpu; "cuda": the ranks share one GPU over gloo, with
QUANTKIT_DIST_BACKEND=gloo).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
from pathlib import Path

CASES = {  # name -> (method, options); shared with the test, which runs the same cases in one process
    "gptq": ("gptq", {"split_min_rows": 16}),
    "gptq_act": ("gptq", {"desc_act": True}),
    "gptq_nts": ("gptq", {"true_sequential": False}),
    "awq": ("awq", {"grid": 4, "clip_grid": 4, "clip_tokens": 64}),
}

MOE_CASES = {  # name -> (method, options, MoE calibration mode, expert token floor)
    "moe_all": ("gptq", {"desc_act": True}, "all", 8),
    "moe_routed": ("gptq", {}, "routed", 40),  # a floor some experts miss: the fallbacks must agree
    "moe_awq": ("awq", {"grid": 4, "clip_grid": 4, "clip_tokens": 64}, "all", 8),
}


def quantize_case(model_dir: str, text: str, out: str, name: str, gpus: int | None = None, device: str = "cpu"):
    from quantkit import api
    from quantkit.config import CalibConfig, LoadConfig, QuantScheme
    from quantkit.methods.moe import MoECalibConfig

    if name in MOE_CASES:
        method, options, mode, floor = MOE_CASES[name]
        moe = MoECalibConfig(mode=mode, min_tokens=floor)
    else:
        (method, options), moe = CASES[name], None
    scheme = QuantScheme(4, 32, method == "gptq")
    return api.quantize(model_dir, out, method=method, scheme=scheme, method_options=dict(options),
                        calib=CalibConfig(source=text, nsamples=8, seqlen=32, seed=0),
                        load=LoadConfig(device=device, dtype="float32"), batch_size=2, gpus=gpus, moe=moe)


def inject_failure(mode: str) -> None:
    """Rank 1 fails while quantizing layer 1: an exception, or SIGKILL (no chance to report)."""
    from quantkit.methods.gptq_method import GPTQMethod

    original = GPTQMethod.quantize_layer

    def failing(self, ctx):
        if ctx.comm.rank == 1 and ctx.index == 1:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected failure on rank 1")
        return original(self, ctx)

    GPTQMethod.quantize_layer = failing


def native_threads() -> list[str] | None:
    """The names of this process's threads (Linux: /proc/self/task/*/comm; None elsewhere)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    names = []
    for task in tasks.iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(names)


def record_threads_at_exit(out: str) -> dict:
    """Write this rank's thread names while the process group works (``during``, filled by the caller) and at exit
    (``exit``), after quantkit's exit handler: registered before the first quantize, this handler runs after the one
    quantkit registers then. The test checks that the group's threads are gone before the interpreter finalizes."""
    seen: dict = {}

    def record() -> None:
        seen["exit"] = native_threads()
        Path(out, f"threads_rank{os.environ['RANK']}.json").write_text(json.dumps(seen))

    atexit.register(record)
    return seen


def main() -> None:
    model_dir, text, out, mode = sys.argv[1:5]
    device = os.environ.get("QUANTKIT_TEST_DEVICE", "cpu")
    assert os.environ.get("NCCL_NVLS_ENABLE") == "0", "the launcher must turn NVLink multicast off"
    if mode not in ("ok", "moe"):
        inject_failure(mode)
        quantize_case(model_dir, text, os.path.join(out, "gptq"), "gptq", gpus=2, device=device)
        return
    threads = record_threads_at_exit(out)
    for name in MOE_CASES if mode == "moe" else CASES:
        quantize_case(model_dir, text, os.path.join(out, name), name, gpus=2, device=device)
    threads["during"] = native_threads()
    if os.environ["RANK"] == "0":
        with open(os.path.join(out, "ranks.json"), "w") as f:
            json.dump({"world_size": int(os.environ["WORLD_SIZE"])}, f)


if __name__ == "__main__":
    main()
