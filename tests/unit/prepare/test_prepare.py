"""launcher.prepare.prepare (`python -m launcher.prepare`): it builds the record index and the data cache a
job with the same overrides would build, so that the job finds them built; bad input is one line."""

from __future__ import annotations

import pytest

from launcher.prepare.prepare import main
from tests.helpers import QUICK, read_summary

DATA = ("data.n_train=64", "data.n_eval=16", "data.num_workers=0")


@pytest.mark.slow  # it trains two steps (in this process)
def test_a_job_starts_on_the_data_prepared_before_it(tmp_path, train_in_process, capsys):
    cache = f"cache_dir={tmp_path / 'cache'}"
    assert main([*DATA, cache]) == 0
    out = capsys.readouterr().out
    assert "records: 64 train, 16 eval (0 bad records skipped while reading" in out
    assert "train: " in out and "(64 records, 0 skipped" in out and "eval: " in out and "built in" in out
    assert list((tmp_path / "cache" / "record_index").glob("*.arrow"))  # the built-in set's files, indexed
    ran = train_in_process(*QUICK, *DATA, cache, run_dir=tmp_path / "run")
    assert ran.outcome.status == "completed", ran.outcome.error
    data_cache = read_summary(tmp_path / "run")["data_cache"]
    assert data_cache["built"] is False and data_cache["path"] in out  # the very cache, found built
    assert main([*DATA, cache]) == 0 and "reused" in capsys.readouterr().out


def test_bad_input_is_one_line_and_a_non_zero_exit(tmp_path, capsys):
    assert main(["data.cache=false", f"cache_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: data.cache=false: the job reads its records as they are; there is no cache to prepare"
    ]
    assert main(["data.streaming=true", f"cache_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: data.streaming=true: the job reads its training records as it trains; there is nothing to prepare"
    ]
    assert main(["data=llava_json", f"data.path={tmp_path / 'missing.json'}", f"cache_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: data.path=") and "no such file" in err[0]
    assert main(["zero.stag=3"]) == 1
    assert "Key 'stag' not in" in capsys.readouterr().err
