from __future__ import annotations

import pytest

from quantkit import api
from quantkit.batch.jobs import EvalSpec, Job
from quantkit.batch.records import checkpoint_path, complete_result, record_path
from quantkit.batch.report import markdown_table, table_rows
from quantkit.batch.runner import BatchObserver, run_batch
from quantkit.config import CalibConfig, LoadConfig, QuantScheme


def _jobs(model, text):
    calib = CalibConfig(source=str(text), nsamples=4, seqlen=32)
    load = LoadConfig(device="cpu", dtype="float32")
    # Built in a loop, as a script would: the Python API takes Job records and returns JobResults.
    return [Job(name=f"{method}-g32", model=str(model), method=method, scheme=QuantScheme(4, 32, sym=False),
                calib=calib, load=load) for method in ("rtn", "gptq")]


def _eval(text):
    return EvalSpec(perplexity=(str(text),), seqlen=32, max_windows=3, kld_max_windows=2)


def test_api_runs_jobs_records_them_and_resumes(tmp_path, tiny_llama_dir, tiny_text_file, monkeypatch):
    out = tmp_path / "out"
    events = []
    observer = BatchObserver(job_started=lambda k, n, job: events.append((k, n, job.name)),
                             on_layer=lambda event: events.append("layer"))
    jobs = _jobs(tiny_llama_dir, tiny_text_file)
    batch = run_batch(jobs, out, eval=_eval(tiny_text_file), observer=observer)
    assert [r.name for r in batch.results] == ["rtn-g32", "gptq-g32"] and not batch.failed
    assert events.count("layer") == 4 and (1, 2, "rtn-g32") in events and (2, 2, "gptq-g32") in events
    for result in batch.results:
        assert result.ok and not result.reused
        assert record_path(out, result.name).is_file()
        assert result.size_bytes > 0 and 4.0 < result.bits_per_weight < 6.0
        assert result.kld["mean_kld"] > 0 and 0 <= result.kld["top1_changed"] <= 1
        assert result.perplexity[str(tiny_text_file)] > 1 and result.peak_host_bytes > 0 and result.seconds > 0
    # The calibrated job only: GPTQ's layer outputs match RTN's less well; both lose something.
    assert batch.results[1].settings["calib"]["nsamples"] == 4 and "calib" not in batch.results[0].settings

    # A second run takes the complete records and quantizes nothing.
    monkeypatch.setattr(api, "quantize", lambda *a, **k: pytest.fail("a complete job ran again"))
    again = run_batch(jobs, out, eval=_eval(tiny_text_file))
    assert all(r.reused for r in again.results)
    assert [r.to_dict() for r in again.results] == [r.to_dict() for r in batch.results]
    # Measured differently or quantized differently: not complete any more.
    other_eval = EvalSpec(perplexity=(str(tiny_text_file),), seqlen=32, max_windows=2, kld_max_windows=2)
    assert complete_result(out, "rtn-g32", jobs[0].settings(), other_eval.to_dict()) is None
    other_job = Job(name="rtn-g32", model=str(tiny_llama_dir), scheme=QuantScheme(4, 64, sym=False))
    assert complete_result(out, "rtn-g32", other_job.settings(), _eval(tiny_text_file).to_dict()) is None
    assert complete_result(out, "rtn-g32", jobs[0].settings(), _eval(tiny_text_file).to_dict()) is not None


def test_failed_job_is_recorded_and_the_batch_goes_on(tmp_path, tiny_llama_dir, tiny_text_file, monkeypatch):
    out = tmp_path / "out"
    real = api.quantize

    def flaky(model, output, **kwargs):
        if kwargs["method"] == "rtn":
            raise RuntimeError("disk on fire")
        return real(model, output, **kwargs)

    monkeypatch.setattr(api, "quantize", flaky)
    batch = run_batch(_jobs(tiny_llama_dir, tiny_text_file), out, eval=_eval(tiny_text_file))
    failed, done = batch.results
    assert batch.failed == [failed] and failed.status == "failed" and "disk on fire" in failed.error
    assert done.ok
    rows = table_rows(out)
    assert [r["status"] for r in rows] == ["ok", "failed: RuntimeError: disk on fire", "ok"]
    # Resuming retries the failed job (now fixed) and keeps the finished one.
    monkeypatch.setattr(api, "quantize", real)
    again = run_batch(_jobs(tiny_llama_dir, tiny_text_file), out, eval=_eval(tiny_text_file))
    assert again.results[0].ok and not again.results[0].reused and again.results[1].reused


def test_checkpoint_without_record_is_redone(tmp_path, tiny_llama_dir, tiny_text_file, monkeypatch):
    from quantkit.batch import runner

    out = tmp_path / "out"
    jobs = _jobs(tiny_llama_dir, tiny_text_file)[:1]
    # Die after the checkpoint is written, before the record: what a kill at that moment leaves.
    monkeypatch.setattr(runner, "write_json_atomic", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        run_batch(jobs, out, eval=_eval(tiny_text_file))
    assert (checkpoint_path(out, "rtn-g32") / "config.json").is_file()
    assert not record_path(out, "rtn-g32").exists()
    monkeypatch.undo()
    result = run_batch(jobs, out, eval=_eval(tiny_text_file)).results[0]
    assert result.ok and not result.reused


def test_shared_inputs_are_computed_once_per_model(tmp_path, tiny_llama_dir, tiny_text_file, monkeypatch):
    from quantkit.calib_data import sources
    from quantkit.eval import kld, perplexity

    counts = {"calib": 0, "eval": 0, "reference": 0}

    def counting(module, name, key):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            counts[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counting(sources, "load_calibration", "calib")
    counting(perplexity, "load_eval_tokens", "eval")
    counting(kld, "store_reference", "reference")
    calib = CalibConfig(source=str(tiny_text_file), nsamples=4, seqlen=32)
    jobs = [Job(name=f"gptq-{bits}", model=str(tiny_llama_dir), method="gptq", scheme=QuantScheme(bits, 32),
                calib=calib, load=LoadConfig(device="cpu", dtype="float32")) for bits in (3, 4)]
    captured = []
    real_quantize = api.quantize
    monkeypatch.setattr(api, "quantize", lambda *a, **k: captured.append(k["calib_tokens"]) or real_quantize(*a, **k))
    batch = run_batch(jobs, tmp_path / "out", eval=_eval(tiny_text_file))
    assert not batch.failed
    assert counts == {"calib": 1, "eval": 1, "reference": 1}
    assert captured[0] is not None and captured[0].shape == (4, 32) and (captured[0] == captured[1]).all()


def test_table_columns_and_pareto_marks(tmp_path, tiny_llama_dir, tiny_text_file):
    out = tmp_path / "out"
    run_batch(_jobs(tiny_llama_dir, tiny_text_file), out, eval=_eval(tiny_text_file))
    rows = table_rows(out)
    assert rows[0]["job"] == "unquantized" and rows[0]["kl_mean"] == 0.0
    assert [r["job"] for r in rows[1:]] == ["rtn-g32", "gptq-g32"]
    assert any("kl" in r["pareto"] for r in rows[1:])
    table = markdown_table(rows, volatile=False)
    assert "seconds" not in table and "peak_host_mib" not in table and "| gptq-g32 |" in table
