"""Checks that need no weights come before the model loads, and the error is the first line (issue #37)."""

from __future__ import annotations

import sys

import pytest

from quantkit import preflight
from quantkit.errors import QuantkitError


def _run_main(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """The console entry point in this process, with every model loader made to fail the test."""
    import quantkit.models.lazy
    import quantkit.models.load

    def no_load(*args, **kwargs):
        pytest.fail("the model was loaded before a check that needs no weights")

    monkeypatch.setattr(quantkit.models.lazy, "open_model", no_load)
    monkeypatch.setattr(quantkit.models.load, "load_model", no_load)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(sys, "argv", ["quantkit", *map(str, argv)])
    from quantkit.cli.app import main

    with pytest.raises(SystemExit) as exc:
        main()
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.mark.parametrize("extra,needle", [
    (["--bits", "5"], "--bits 5 is not supported"),
    (["--bits", "0"], "--bits 0 is not supported"),
    (["--group-size", "20"], "--group-size 20 cannot be stored"),
    (["--seqlen", "99999"], "--seqlen 99999 is longer than the model's 256 positions"),
    (["--calib", "/no/such/calib.txt"], "/no/such/calib.txt"),
])
def test_gptq_refuses_before_loading_with_the_error_first(extra, needle, tiny_llama_dir, tmp_path, monkeypatch,
                                                           capsys):
    code, out, err = _run_main(["gptq", tiny_llama_dir, "-o", tmp_path / "o", *extra], monkeypatch, capsys)
    assert code == 2, err
    assert err.splitlines()[0].startswith("error: ") and needle in err.splitlines()[0], err
    assert out == "" and "Traceback" not in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("model,needle", [
    ("/no/such/model", "model folder /no/such/model does not exist"),
    ("/no/such/model.gguf", "GGUF file /no/such/model.gguf does not exist"),
    ("some-org/not-a-cached-model", "not in the local cache"),
])
def test_missing_model_is_the_first_line(model, needle, tmp_path, monkeypatch, capsys):
    code, out, err = _run_main(["gptq", model, "-o", tmp_path / "o", "--calib", "self"], monkeypatch, capsys)
    assert code == 2
    first = err.splitlines()[0]
    assert first.startswith("error: ") and needle in first, err
    assert "loading" not in err and "INFO" not in err


def test_a_folder_without_config_says_what_it_holds(tmp_path, monkeypatch, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.gguf").write_bytes(b"")
    code, _, err = _run_main(["rtn", tmp_path / "m", "-o", tmp_path / "o"], monkeypatch, capsys)
    assert code == 2 and "has no config.json (it holds model.gguf: pass that file)" in err.splitlines()[0]


def test_existing_output_folder_is_refused_first(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep").write_text("x")
    code, _, err = _run_main(["gptq", tiny_llama_dir, "-o", tmp_path / "o"], monkeypatch, capsys)
    assert code == 2 and "already exists" in err.splitlines()[0]
    assert (tmp_path / "o" / "keep").read_text() == "x"


def test_max_positions_read_from_config_json_alone(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llava", "text_config": {"max_position_embeddings": 4096}}')
    assert preflight.model_max_positions(str(tmp_path)) == 4096
    (tmp_path / "config.json").write_text('{"n_positions": 1024}')
    assert preflight.model_max_positions(str(tmp_path)) == 1024
    with pytest.raises(QuantkitError, match="--seqlen 2048 is longer than the model's 1024 positions"):
        preflight.check_seqlen(str(tmp_path), 2048)
    preflight.check_seqlen(str(tmp_path), 1024)


def test_max_positions_of_a_gguf_file(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(777)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert preflight.model_max_positions(str(path)) == 777
