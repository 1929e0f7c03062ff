"""How ranks agree on a failure, simulated in one process: the other ranks' reports are
prepared, this rank's is the real one. And the exception hierarchy a failure is raised in."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

import torchrec_cnr.errors as errors
from torchrec_cnr.collectives import Collective, Failure
from torchrec_cnr.errors import (
    CheckpointError,
    CheckpointReadError,
    CnrError,
    ManifestError,
    ModelMismatchError,
    RemoteTraceback,
)

T = TypeVar("T")


class _Simulated(Collective):
    """Rank ``rank`` of a group whose other ranks report what ``peers`` holds.

    Args:
        rank: this rank.
        peers: every rank's report to :meth:`gather`, this rank's slot ignored.
        from_rank0: what rank 0 broadcasts, as seen by any other rank.
    """

    def __init__(self, rank: int, peers: list[Any], from_rank0: Any = None) -> None:
        self.pg = None
        self.rank = rank
        self.world_size = len(peers)
        self.peers = peers
        self.from_rank0 = from_rank0
        self.gathered: list[Any] = []

    def gather(self, obj: T) -> list[T]:
        out: list[Any] = list(self.peers)
        out[self.rank] = obj
        self.gathered = out
        return out

    def broadcast(self, obj: T | None, src: int = 0) -> T:
        assert src == 0
        return obj if self.rank == src else self.from_rank0  # type: ignore[return-value]


def _raised(error: BaseException) -> BaseException:
    """``error`` raised and caught, so it carries a traceback."""
    try:
        _fail_deep_inside(error)
    except BaseException as caught:
        return caught
    raise AssertionError("unreachable")


def _fail_deep_inside(error: BaseException) -> None:
    raise error


def _report(error: BaseException) -> Failure:
    return Failure.of(_raised(error))


class _NeedsTwoArguments(Exception):
    def __init__(self, path: str, code: int) -> None:
        super().__init__(f"{path} failed with {code}")


# agree


def test_agree_returns_when_no_rank_failed() -> None:
    collective = _Simulated(0, [None, None, None])
    collective.agree(None)
    assert collective.gathered == [None, None, None]


def test_a_failing_rank_raises_the_agreed_error_caused_by_its_own_exception() -> None:
    own = _raised(OSError(28, "no space left on device"))
    with pytest.raises(OSError) as info:
        _Simulated(0, [None, None]).agree(own)
    assert type(info.value) is OSError
    assert str(info.value) == f"on rank 0: {own}"
    assert info.value.__cause__ is own
    assert getattr(info.value, "rank", None) == 0
    assert getattr(info.value, "remote_traceback", None) == Failure.of(own).traceback


def test_every_rank_raises_the_lowest_failing_ranks_error_naming_the_others() -> None:
    rank0 = _report(ValueError("rank 0's"))
    own = _raised(KeyError("mine"))
    raised = []
    for rank, peers, mine in [
        (2, [rank0, None, None], own),
        (1, [rank0, None, Failure.of(own)], None),
    ]:
        with pytest.raises(ValueError) as info:
            _Simulated(rank, peers).agree(mine)
        raised.append(info.value)
        assert type(info.value) is ValueError and getattr(info.value, "rank", None) == 0
        assert isinstance(info.value.__cause__, RemoteTraceback)
    assert (
        str(raised[0]) == str(raised[1]) == "on rank 0: rank 0's; also on rank 2: KeyError: 'mine'"
    )


def test_every_rank_sends_its_failure_with_its_traceback() -> None:
    collective = _Simulated(0, [None, None])
    own = _raised(ValueError("bad row"))
    with pytest.raises(ValueError):
        collective.agree(own)
    sent = collective.gathered[0]
    assert isinstance(sent, Failure)
    assert sent.kind is ValueError and sent.message == "bad row"
    assert "_fail_deep_inside" in sent.traceback


def test_another_ranks_failure_is_raised_as_its_type_naming_the_rank() -> None:
    failure = _report(ValueError("disk full"))
    with pytest.raises(ValueError) as info:
        _Simulated(0, [None, failure]).agree(None)
    error = info.value
    assert type(error) is ValueError
    assert str(error) == "on rank 1: disk full"
    assert getattr(error, "rank", None) == 1
    remote = getattr(error, "remote_traceback", None)
    assert remote == failure.traceback
    assert "Traceback" in remote and "_fail_deep_inside" in remote and "disk full" in remote
    assert isinstance(error.__cause__, RemoteTraceback)
    assert str(error.__cause__) == failure.traceback


def test_a_library_error_from_another_rank_keeps_its_type_and_fields() -> None:
    with pytest.raises(CheckpointError) as info:
        _Simulated(0, [None, _report(CheckpointError("write failed"))]).agree(None)
    assert isinstance(info.value, CnrError)
    assert info.value.rank == 1
    assert info.value.remote_traceback is not None
    assert "write failed" in info.value.remote_traceback


def test_a_type_that_cannot_be_built_from_a_message_becomes_runtime_error() -> None:
    failure = _report(_NeedsTwoArguments("/ckpt", 5))
    with pytest.raises(RuntimeError) as info:
        _Simulated(0, [None, failure]).agree(None)
    assert type(info.value) is RuntimeError
    assert str(info.value) == "_NeedsTwoArguments: on rank 1: /ckpt failed with 5"
    assert getattr(info.value, "rank", None) == 1
    assert isinstance(info.value.__cause__, RemoteTraceback)


def test_a_base_exception_of_another_rank_becomes_runtime_error() -> None:
    with pytest.raises(RuntimeError) as info:
        _Simulated(0, [None, _report(KeyboardInterrupt("stop"))]).agree(None)
    assert str(info.value) == "KeyboardInterrupt: on rank 1: stop"


def test_the_lowest_failing_rank_wins() -> None:
    peers = [None, None, _report(KeyError("rank 2")), _report(ValueError("rank 3"))]
    with pytest.raises(KeyError) as info:
        _Simulated(0, peers).agree(None)
    assert getattr(info.value, "rank", None) == 2


# agree_on


def test_agree_on_returns_the_result_when_every_rank_succeeded() -> None:
    assert _Simulated(0, [None, None]).agree_on(lambda: 42) == 42


def test_agree_on_raises_this_ranks_error_as_every_rank_does() -> None:
    own = ValueError("here")

    def fail() -> int:
        raise own

    with pytest.raises(ValueError) as info:
        _Simulated(0, [None, None]).agree_on(fail)
    assert str(info.value) == "on rank 0: here" and info.value.__cause__ is own


def test_agree_on_raises_another_ranks_failure_even_though_this_rank_succeeded() -> None:
    with pytest.raises(ManifestError) as info:
        _Simulated(0, [None, _report(ManifestError("damaged"))]).agree_on(lambda: 42)
    assert str(info.value) == "on rank 1: damaged"


# on_rank0


def _counting(result: T) -> tuple[Callable[[], T], list[int]]:
    calls: list[int] = []

    def fn() -> T:
        calls.append(1)
        return result

    return fn, calls


def test_on_rank0_runs_only_on_rank_0_and_gives_every_rank_its_result() -> None:
    fn, calls = _counting("manifest")
    assert _Simulated(0, [None, None]).on_rank0(fn) == "manifest"
    assert calls == [1]
    other, other_calls = _counting("not run")
    assert _Simulated(1, [None, None], from_rank0=(True, "manifest")).on_rank0(other) == "manifest"
    assert other_calls == []


def test_on_rank0_raises_rank_0s_error_there_as_the_others_do() -> None:
    own = CheckpointReadError("missing file")

    def fail() -> None:
        raise own

    with pytest.raises(CheckpointReadError) as info:
        _Simulated(0, [None, None]).on_rank0(fail)
    assert str(info.value) == "on rank 0: missing file"
    assert info.value.rank == 0 and info.value.__cause__ is own


def test_on_rank0_raises_rank_0s_failure_on_the_other_ranks() -> None:
    failure = _report(CheckpointReadError("missing file"))
    fn, calls = _counting(None)
    with pytest.raises(CheckpointReadError) as info:
        _Simulated(1, [None, None], from_rank0=(False, failure)).on_rank0(fn)
    assert str(info.value) == "on rank 0: missing file"
    assert info.value.rank == 0 and info.value.remote_traceback == failure.traceback
    assert calls == []


def test_an_error_wrapping_an_agreed_failure_keeps_its_rank_and_traceback() -> None:
    failure = _report(OSError("disk full"))
    with pytest.raises(OSError) as info:
        _Simulated(0, [None, failure]).agree(None)
    wrapped = errors.wrapping(CheckpointError(f"save failed: {info.value}"), info.value)
    again = errors.wrapping(CheckpointError(f"outer: {wrapped}"), wrapped)
    for error in (wrapped, again):
        assert error.rank == 1 and error.remote_traceback == failure.traceback
    assert again.__cause__ is wrapped and "on rank 1: disk full" in str(again)
    assert errors.wrapping(CheckpointError("local"), ValueError("x")).rank is None


# The exception hierarchy


def _exception_classes() -> list[type[BaseException]]:
    return [
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, BaseException) and obj.__module__ == errors.__name__
    ]


def test_every_library_error_derives_from_cnr_error() -> None:
    classes = _exception_classes()
    assert len(classes) >= 7
    assert RemoteTraceback in classes
    assert [c for c in classes if not issubclass(c, CnrError)] == []
    assert set(errors.__all__) == {c.__name__ for c in classes}


def test_library_errors_keep_their_builtin_bases() -> None:
    assert issubclass(ManifestError, ValueError)
    assert issubclass(ModelMismatchError, ValueError)
    assert issubclass(CheckpointError, RuntimeError)
    assert issubclass(CheckpointReadError, RuntimeError)
    assert issubclass(errors.ChecksumError, CheckpointReadError)


def test_a_group_of_one_runs_without_a_process_group_and_raises_its_own_error() -> None:
    alone = Collective.alone()
    assert (alone.rank, alone.world_size) == (0, 1)
    assert alone.on_rank0(lambda: 7) == 7 and alone.gather("x") == ["x"]
    assert alone.any(True) and not alone.any(False) and alone.max([1.0, 2.0]) == [1.0, 2.0]

    def fail() -> None:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="on rank 0: disk gone") as info:
        alone.on_rank0(fail)
    assert isinstance(info.value.__cause__, OSError)
