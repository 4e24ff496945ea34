import argparse
from typing import Any, Iterable, Sequence

VALUE_OPTIONS: dict[str, str]
FLAG_OPTIONS: dict[str, str]

def frame_timing(written: list, start: float, end: float) -> dict[str, float]: ...
def job_argv(args: argparse.Namespace | Sequence[str]) -> list[str]: ...
def main(
    args: argparse.Namespace | Sequence[str],
    comm: Any = ...,
    timing: dict | None = ...,
    coordinator: Any = ...,
) -> None: ...
def main_exposure(
    list_of_args: Iterable[argparse.Namespace | Sequence[str]],
    comm: Any = ...,
    frame_groups: int = ...,
    async_io: bool = ...,
) -> int: ...
