"""Where flags become a contract: :func:`cli.submit_errors.flags_contract` is the one
place a pydantic refusal is the user's doing (a :class:`FlagError` naming the flag,
``mlscope``'s exit 2). A refusal raised anywhere else, even by a library called from a
command's own module, is not a flag error and keeps its traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError, validate_call

import cli.cancel_cmd
from cli.main import main as mlscope_main
from cli.submit_errors import FlagError, flags_contract
from mlscope.contracts import ScenarioSpec
from mlscope.errors import ConfigError
from mlscope.settings import Settings

NOWHERE = Settings(nats_url="nats://127.0.0.1:9")
"""No server listens there: nothing in these tests may connect."""


@pytest.fixture
def nowhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key, value in NOWHERE.with_(data_dir=tmp_path / "data").as_env().items():
        monkeypatch.setenv(key, value)


def test_a_refusal_inside_the_boundary_names_the_flag() -> None:
    with pytest.raises(FlagError) as info, flags_contract():
        ScenarioSpec(name="online", qps=-1.0)
    assert str(info.value) == "argument --qps: must be greater than 0 (got -1.0)"
    assert isinstance(info.value, ConfigError)
    assert isinstance(info.value.__cause__, ValidationError)


def test_the_boundary_translates_nothing_else() -> None:
    with pytest.raises(KeyError), flags_contract():
        raise KeyError("qps")
    with pytest.raises(ValueError, match="not pydantic's") as info, flags_contract():
        raise ValueError("not pydantic's")
    assert not isinstance(info.value, FlagError)


def test_a_bad_flag_is_exit_2_with_one_line(
    nowhere: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code = mlscope_main(["demo", "--qps", "1e9"])
    err = capsys.readouterr().err
    assert code == 2
    says = "argument --qps: must be less than or equal to 1000000 (got 1000000000.0)"
    assert err == f"mlscope demo: error: {says}\n"


def test_a_library_refusal_in_a_command_module_is_not_a_flag_error(
    nowhere: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call that fails is in ``cli/cancel_cmd.py`` itself, straight into pydantic:
    no flag became a contract there, so it is a bug, raised as such (not exit 2)."""

    @validate_call
    def cancel_job(settings: object, job_id: int, *, timeout: float) -> None:
        raise AssertionError("pydantic refuses job_id before this runs")

    monkeypatch.setattr(cli.cancel_cmd, "cancel_job", cancel_job)
    with pytest.raises(ValidationError):
        mlscope_main(["cancel", "job-1"])
    assert "error: argument" not in capsys.readouterr().err
